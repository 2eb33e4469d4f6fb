"""The prepared accelerator check runs end to end on the CPU with tiny shapes, and everything in it is lossless."""

import importlib.util
import json
from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "device_check.py"


def test_device_check_runs_tiny_on_the_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "check.json"
    report = module.main(["--device", "cpu", "--tiny", "--skip-default", "--new-tokens", "20", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for kind, result in report["lossless"].items():
        assert result["batch_1_identical"] and result["batch_3_identical"], kind
    assert report["lossless"]["oracle"]["tau"] > report["lossless"]["random"]["tau"]
    speed = report["speed"]
    assert all(speed[f"acceptance_{a}"]["identical"] for a in (1.0, 0.7, 0.4))
    taus = [speed[f"acceptance_{a}"]["tau"] for a in (1.0, 0.7, 0.4)]
    assert taus == sorted(taus, reverse=True) and taus[0] > 4  # forced acceptance shows in τ
    assert all(speed[f"acceptance_{a}"]["overhead_ms_per_round"] > 0 for a in (1.0, 0.7, 0.4))
    for name, result in report["quantized"].items():  # whichever quantization backends are installed here
        if name != "not_checked":
            assert "error" not in result, (name, result)
            assert all(
                result[d]["batch_1_identical"] and result[d]["batch_3_identical"] for d in ("random", "diverging")
            )
