"""Summarise, verify or decode a dataset folder made by preprocess.py. Examples:

    python data_tools/inspect_shards.py demo_out/data
    python data_tools/inspect_shards.py demo_out/data --verify \\
        --tokenizer demo_out/tokenizer/spm.model
    python data_tools/inspect_shards.py demo_out/data --decode 3 \\
        --tokenizer demo_out/tokenizer/spm.model
    python data_tools/inspect_shards.py data/mmbert --config configs/mmbert.yaml

Exit code 1 when --verify finds problems, 2 on an unreadable dataset.
"""

import argparse
import sys

import _path  # noqa: F401

from megatron_rembert.cli import run_cli
from megatron_rembert.prep.inspection import (
    config_sampling_table,
    decode_samples,
    summarize,
    verify,
)


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_dir")
    p.add_argument("--verify", action="store_true",
                   help="check checksums, schema, counts and the token-id range of every shard")
    p.add_argument("--decode", type=int, metavar="N", default=0,
                   help="print N random rows as text (needs --tokenizer)")
    p.add_argument("--split", choices=["train", "valid"], default="train")
    p.add_argument("--tokenizer", help="SentencePiece .model the dataset was made with")
    p.add_argument("--config", help="a training config: also print each language's sampling "
                   "probability in every phase of its schedule")
    a = p.parse_args(argv)
    print(summarize(a.data_dir))
    if a.config:
        print(config_sampling_table(a.data_dir, a.config))
    if a.verify:
        problems = verify(a.data_dir, a.tokenizer)
        for msg in problems:
            print(f"PROBLEM: {msg}")
        print(f"verify: {len(problems)} problem(s)")
        if problems:
            return 1
    if a.decode:
        if not a.tokenizer:
            p.error("--decode needs --tokenizer PATH.model")
        for lang, text in decode_samples(a.data_dir, a.tokenizer, a.decode, a.split):
            print(f"--- [{lang}] {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
