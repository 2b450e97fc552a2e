"""Compile every Triton kernel of megatron_rembert.kernels for sm_80 and sm_90, without a GPU.

    python -m tests.kernels.aot_compile [--shard 0 --shards 2]     # from the repository root

Must run WITHOUT TRITON_INTERPRET: under it `triton.jit` returns interpreter objects that
cannot be compiled (test_aot_compile.py starts this in subprocesses with the variable unset).
Kernels are found by importing every module of the package and collecting its JITFunctions;
each must be covered by its module's `aot_configs()` (see megatron_rembert/kernels/aot.py).
Prints JSON lines: one {"discovered": ..., "problems": ...}, then one result per compile
({"label", "arch", "error"} or {"label", "arch", "reg", "stack", "local"}).
`--spill-probe` instead compiles one kernel with a register cap that forces spills, to show
that the resource check sees them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import subprocess
import tempfile
from pathlib import Path

ARCHS = (80, 90)
PACKAGE = "megatron_rembert.kernels"
USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")


def discover() -> tuple[list[str], list, list[str]]:
    """(qualified kernel names, declared KernelConfigs, problems) of the whole package."""
    from triton.runtime.jit import JITFunction

    package = importlib.import_module(PACKAGE)
    names, configs, problems = [], [], []
    for info in pkgutil.walk_packages(package.__path__, PACKAGE + "."):
        module = importlib.import_module(info.name)
        kernels = {id(obj): f"{info.name}.{name}" for name, obj in vars(module).items()
                   if isinstance(obj, JITFunction) and obj.fn.__module__ == info.name}
        names += kernels.values()
        if not kernels:
            continue
        if not hasattr(module, "aot_configs"):
            problems.append(f"{info.name} defines Triton kernels but no aot_configs()")
            continue
        declared = module.aot_configs()
        configs += declared
        for key in kernels.keys() - {id(c.kernel) for c in declared}:
            problems.append(f"{kernels[key]} has no configuration in {info.name}.aot_configs()")
    return sorted(names), configs, problems


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack and local bytes per thread, from cuobjdump on the cubin. Spills show
    up as STACK, not LOCAL (the spill probe: 72 bytes of spill stores per `ptxas -v` read as
    STACK 128, LOCAL 0 in cuobjdump 13.1), so a spill-free kernel has both at 0."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    match = USAGE.search(out)
    if match is None:
        raise RuntimeError(f"no resource usage line in cuobjdump output:\n{out}")
    reg, stack, local = map(int, match.groups())
    return dict(reg=reg, stack=stack, local=local)


def compile_one(config, arch: int, **options: int) -> dict:  # noqa: ANN001
    """Compile one KernelConfig for sm_<arch> with the real compiler and ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget

    # torch allocations are 16-byte aligned and the JIT specializes on it: so do we
    aligned = {(i,): [["tt.divisibility", 16]]
               for i, t in enumerate(config.signature.values()) if t.startswith("*")}
    result = dict(label=config.label, arch=arch)
    try:
        src = triton.compiler.ASTSource(fn=config.kernel, signature=config.signature,
                                        constexprs=config.constexprs, attrs=aligned)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": config.num_warps, **options})
        return result | resource_usage(compiled.asm["cubin"])
    except Exception as exc:  # noqa: BLE001 - reported per configuration, checked by the test
        return result | dict(error=f"{type(exc).__name__}: {exc}"[-1500:])


def spill_probe() -> dict:
    """A shipped configuration (masked fp32 softmax forward, 4096 keys, 8 warps: ~54 registers)
    capped at 24 registers per thread, so ptxas must spill and the check must report it."""
    from megatron_rembert.kernels import softmax
    from megatron_rembert.kernels.aot import kernel_config

    config = kernel_config(
        softmax._softmax_fwd_kernel, 8,
        {"x_ptr": "*fp32", "mask_ptr": "*i8", "p_ptr": "*fp32", "Sk": "i32",
         "rows_per_batch": "i32", "scale": "fp32"},
        HAS_MASK=True, BLOCK=4096,
    )
    return compile_one(config, 90, maxnreg=24)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--spill-probe", action="store_true")
    p.add_argument("--archs", default=",".join(map(str, ARCHS)),
                   help="sm_<arch> targets, comma-separated (default: ARCHS)")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    if args.spill_probe:
        print(json.dumps(spill_probe()), flush=True)
        return
    names, configs, problems = discover()
    print(json.dumps(dict(discovered=names, problems=problems, configs=len(configs))),
          flush=True)
    archs = [int(a) for a in args.archs.split(",")]
    jobs = [(c, arch) for c in configs for arch in archs][args.shard::args.shards]
    for config, arch in jobs:
        print(json.dumps(compile_one(config, arch)), flush=True)


if __name__ == "__main__":
    main()
