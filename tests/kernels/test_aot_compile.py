"""Every Triton kernel of the package compiles for sm_80 and sm_90, without spills, at every
configuration its launcher can choose, for fp32, bf16 and fp16. No GPU: triton's own compiler
and ptxas run on CPU. The rest of tests/kernels runs the kernels under TRITON_INTERPRET, which
accepts code the compiler refuses (a kernel reading a plain module global, for one), so this
is the check that the kernels build at all. The compiles run in subprocesses without
TRITON_INTERPRET (see tests/kernels/aot_compile.py), two at a time. On a GPU (`pytest -m gpu`)
also for that GPU's own architecture."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts processes

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "megatron_rembert" / "kernels"
SHARDS = 2  # the CI machines have 2 cores


def worker_env(cache_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)  # a fresh cache: really compile, every run
    return env


def run_workers(args_per_worker: list[list[str]], cache_dir: Path) -> list[list[dict]]:
    """Run `python -m tests.kernels.aot_compile ARGS` once per entry, concurrently."""
    procs = [subprocess.Popen([sys.executable, "-m", "tests.kernels.aot_compile", *args],
                              cwd=ROOT, env=worker_env(cache_dir), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for args in args_per_worker]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"compile worker failed:\n{err[-3000:]}"
        outputs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    return outputs


def jit_decorators_in_source() -> int:
    """`@triton.jit` lines in the package source: an independent count of the kernels."""
    pattern = re.compile(r"^\s*@triton\.jit\b", re.MULTILINE)
    return sum(len(pattern.findall(p.read_text())) for p in PACKAGE_DIR.rglob("*.py"))


def test_every_kernel_compiles_without_spills(tmp_path: Path) -> None:
    shards = run_workers([["--shard", str(i), "--shards", str(SHARDS)] for i in range(SHARDS)],
                         tmp_path)
    header = shards[0][0]
    assert header["problems"] == [], "\n".join(header["problems"])
    # the scan must see every kernel the source declares (e.g. not one hidden in a function)
    assert len(header["discovered"]) == jit_decorators_in_source() >= 4, header["discovered"]
    results = [r for shard in shards for r in shard[1:]]
    assert len(results) == 2 * header["configs"]  # each configuration for sm_80 and sm_90
    assert_compiled_without_spills(results)


@pytest.mark.gpu
def test_every_kernel_compiles_for_this_gpu(tmp_path: Path) -> None:
    """The same for the architecture of the GPU at hand (sm_90 on an H100 or H200, sm_100 on
    a B200, ...): what the JIT builds there, compiled and checked for spills."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    (shard,) = run_workers([["--archs", str(10 * major + minor)]], tmp_path)
    header, results = shard[0], shard[1:]
    assert header["problems"] == [], "\n".join(header["problems"])
    assert len(results) == header["configs"] > 0
    assert_compiled_without_spills(results)


def assert_compiled_without_spills(results: list[dict]) -> None:
    failed = [f"sm_{r['arch']} {r['label']}: {r['error']}" for r in results if "error" in r]
    assert not failed, f"{len(failed)} of {len(results)} compiles failed:\n" + "\n".join(
        failed[:5])
    spilled = [f"sm_{r['arch']} {r['label']}: {r}" for r in results
               if r["local"] or r["stack"]]
    assert not spilled, "register spills (local memory):\n" + "\n".join(spilled)
    assert all(0 < r["reg"] <= 255 for r in results)


def test_resource_check_sees_a_spill(tmp_path: Path) -> None:
    """The spill check can fail: a shipped kernel capped at 24 registers per thread spills."""
    (probe,) = run_workers([["--spill-probe"]], tmp_path)[0]
    assert "error" not in probe, probe
    assert probe["reg"] <= 24 and probe["stack"] + probe["local"] > 0, probe
