"""Merge dataset folders made by preprocess.py from disjoint sets of languages into one folder
with one manifest.json (slurm/preprocess.sbatch runs one part per array task). Example:

    python data_tools/merge_datasets.py --out demo_out/data demo_out/data.parts/*

Languages are packed independently, so the merged folder holds the same shards, in the same
order, as one preprocess.py run over all the languages. Shards are hard-linked when the parts
are on the same file system (no extra space), copied otherwise; manifest.json is written last,
so a killed merge leaves no dataset behind and a rerun finishes it.
"""

import argparse
import sys
from pathlib import Path

import _path  # noqa: F401

from megatron_rembert.cli import run_cli
from megatron_rembert.data.shards import MANIFEST
from megatron_rembert.fs import is_inside, unwritable_reason
from megatron_rembert.prep.merge import merge


def main(argv: list[str] | None = None) -> int:
    # Bad input exits 2 (docs/data.md); a file system failing while writing exits 1: nothing
    # committed is damaged.
    return run_cli(_main, argv, on_os_error="free space and rerun the same command")


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="+", type=Path, help="dataset folders made by preprocess.py")
    p.add_argument("--out", required=True, type=Path, help="merged dataset folder")
    a = p.parse_args(argv)
    # Output checks first: nothing is linked or copied before they pass.
    for part in a.parts:
        if is_inside(a.out, part):
            p.error(f"--out {a.out} is inside the part {part}; merge into a new folder")
    if reason := unwritable_reason(a.out):
        p.error(f"--out {a.out}: {reason}")
    manifest = merge(a.parts, a.out)
    print(f"merged {len(a.parts)} part(s): {len(manifest['languages'])} languages, "
          f"{len(manifest['shards'])} shards -> {a.out}/{MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
