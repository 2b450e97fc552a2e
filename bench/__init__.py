"""Benchmarks and acceptance checks, each a module run from the repository root:

    python -m bench.<name> [--help]

The root on the module path is all they need (a bare checkout on a GPU machine, the package
not installed). Shared pieces live in one place each: `bench.common` (timing, device sync,
synthetic batches, JSON figures, relative error) and `bench.memwatch` (memory read from
/proc). Every script module has `main()` and `TINY_ARGS`, the arguments of its smallest run
(seconds, on CPU), which tests/bench/test_every_bench.py runs so that a broken bench fails
CI; a script that needs CUDA says so with `NEEDS_CUDA = True` and refuses cleanly without it.
"""
