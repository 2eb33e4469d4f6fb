"""`kernels.allocator`: glibc's malloc keeps freed memory in the `dspark-hf` process, and only there."""

import os
import subprocess
import sys

import pytest

from dspark_hf import cli
from dspark_hf.kernels import allocator


class FakeLibc:
    def __init__(self, result=1):
        self.calls, self.result = [], result

    def mallopt(self, parameter, value):
        self.calls.append((parameter, value))
        return self.result


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", False)
    monkeypatch.delenv("DSPARK_SYSTEM_MALLOC", raising=False)


def test_sets_mmap_off_and_a_high_trim_threshold_once(monkeypatch, fresh):
    libc = FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    assert allocator.keep_freed_memory() and allocator.keep_freed_memory()
    assert libc.calls == [(allocator.M_MMAP_MAX, 0), (allocator.M_TRIM_THRESHOLD, 2**31 - 1)]  # once


@pytest.mark.parametrize("case", ["opted out", "not glibc", "refused"])
def test_changes_nothing_otherwise(monkeypatch, fresh, case):
    libc = FakeLibc(result=0 if case == "refused" else 1)
    monkeypatch.setattr(allocator, "_glibc", lambda: None if case == "not glibc" else libc)
    if case == "opted out":
        monkeypatch.setenv("DSPARK_SYSTEM_MALLOC", "1")
    assert allocator.keep_freed_memory() is False
    assert libc.calls == ([(allocator.M_MMAP_MAX, 0)] if case == "refused" else [])


def test_the_command_line_applies_it(monkeypatch, capsys):
    called = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: called.append(True))
    assert cli.main(["export", "--format", "gguf", "--drafter", "/no/such/drafter", "--out", "x.gguf"]) == 2
    assert called == [True] and "error" in capsys.readouterr().err


FAULTS = """
import importlib.util, resource, sys, torch
spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])  # the module alone: a quicker start
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
print(allocator.keep_freed_memory())
for _ in range(6):  # the first ones grow the heap (an aligned block needs a little more than the one freed)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(64 << 18)  # 64 MB, above glibc's largest mmap threshold
    del x
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's malloc only")
@pytest.mark.parametrize("system", [False, True])
def test_a_freed_block_is_reused_without_page_faults(system):
    """Once the heap has grown, a 64 MB tensor touches no new pages (16k faults each with glibc's defaults: the
    negative control)."""
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_SYSTEM_MALLOC"}
    env |= {"DSPARK_SYSTEM_MALLOC": "1"} if system else {}
    command = [sys.executable, "-c", FAULTS, allocator.__file__]
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    applied, faults = out.split()[0] == "True", [int(n) for n in out.split()[-3:]]  # the last three tensors
    assert applied is not system
    assert min(faults) > 10_000 if system else max(faults) < 1_000
