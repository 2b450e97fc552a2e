"""Looking into a dataset folder: summary, full verification, decoding samples back to text."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from megatron_rembert.cli import format_table
from megatron_rembert.data.common import DataError
from megatron_rembert.data.config import DataConfig
from megatron_rembert.data.sampler import MultilingualSampler, language_weights
from megatron_rembert.data.schedule import Schedule
from megatron_rembert.data.shards import MANIFEST, ShardDataset, open_shard, read_manifest
from megatron_rembert.fs import sha256_file


def summary_table(manifest: dict, alpha: float = 0.5) -> str:
    """Per-language table: documents, rows, tokens, share, sampling probability at alpha."""
    langs = manifest["languages"]
    total = sum(v["train_tokens"] for v in langs.values()) or 1
    probs = dict(zip(langs, language_weights([v["train_tokens"] for v in langs.values()],
                                             alpha).tolist(), strict=True))
    rows = [[lang, v["documents"], v["train_rows"], v["valid_rows"], v["train_tokens"],
             f"{100 * v['train_tokens'] / total:.1f}%", f"{100 * probs[lang]:.1f}%"]
            for lang, v in sorted(langs.items())]
    header = ["lang", "docs", "train seqs", "valid seqs", "train tokens", "share",
              f"p(alpha={alpha})"]
    return format_table(header, rows)


def sampling_table(manifest: dict, data: DataConfig, steps: int) -> str:
    """Per language: its share of the training tokens and its sampling probability in each
    stretch of a config's schedule (a column per phase start and language entry, as the
    sampler cuts the stream). A language the dataset lacks is a DataError naming it."""
    langs = sorted(manifest["languages"])
    unknown = sorted(set(data.language_start) - set(langs))
    if unknown:
        raise DataError(f"data.language_start names {unknown}, which the dataset does not "
                        f"have (its languages: {', '.join(langs)})")
    tokens = [manifest["languages"][x]["train_tokens"] for x in langs]
    rows = [manifest["languages"][x]["train_rows"] for x in langs]
    schedule = Schedule(data, steps)
    columns, header = [], ["lang", "share"]
    for step, alpha, active in schedule.segments(langs):
        sampler = MultilingualSampler(rows, tokens, alpha, active=active)
        columns.append(sampler.probs)
        header.append(f"phase {schedule.phases.index(schedule.phase(step))} "
                      f"step {step:,} alpha {alpha:g}")
    total = sum(tokens) or 1
    table = [[lang, f"{100 * tokens[i] / total:.1f}%",
              *(f"{100 * c[i]:.1f}%" for c in columns)] for i, lang in enumerate(langs)]
    return "sampling probability by phase:\n" + format_table(header, table)


def config_sampling_table(data_dir: str | os.PathLike, config_path: str | os.PathLike) -> str:
    """`sampling_table` of a dataset under the schedule of a training config (checked first)."""
    from megatron_rembert.run_config.checks import check_ranges
    from megatron_rembert.run_config.load import load_config

    config = load_config(config_path)
    check_ranges(config)
    return sampling_table(read_manifest(data_dir), config.data, config.train.steps)


def summarize(data_dir: str | os.PathLike, alpha: float = 0.5) -> str:
    m = read_manifest(data_dir)
    skipped = {k: v for k, v in m["skipped"].items() if v}
    return "\n".join([
        f"dataset {data_dir}: schema {m['schema_version']}, sequence length {m['seq_length']}, "
        f"{len(m['shards'])} shards",
        f"tokenizer {m['tokenizer']['model_file']} sha256 {m['tokenizer']['sha256']} "
        f"vocab {m['tokenizer']['vocab_size']:,}; special ids {m['special_ids']}",
        summary_table(m, alpha),
        f"skipped input: {skipped or 'nothing'}",
    ])


def verify(data_dir: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> list[str]:
    """Check every shard's checksum, schema, row and token counts and id range; with a
    tokenizer, also that it is the one the dataset was made with. Returns the problems found
    (empty: the dataset is sound), each naming its file."""
    data_dir = Path(data_dir)
    m = read_manifest(data_dir)
    problems = []
    if tokenizer is not None and sha256_file(tokenizer) != m["tokenizer"]["sha256"]:
        problems.append(f"{data_dir / MANIFEST}: made with another tokenizer than {tokenizer}")
    ws = data_dir / m["word_starts"]["file"]
    if not ws.is_file() or sha256_file(ws) != m["word_starts"]["sha256"]:
        problems.append(f"{ws}: missing or sha256 differs from the manifest")
    vocab, pad, cls = (m["tokenizer"]["vocab_size"], m["special_ids"]["pad"],
                       m["special_ids"]["cls"])
    for entry in m["shards"]:
        path = data_dir / entry["file"]
        try:
            ids = open_shard(path, entry, m["seq_length"])
        except DataError as e:
            problems.append(str(e))
            continue
        if sha256_file(path) != entry["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest (modified or corrupt)")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            problems.append(f"{path}: token ids outside [0, {vocab}): "
                            f"min {ids.min()}, max {ids.max()}")
        if (ids[:, 0] != cls).any():
            problems.append(f"{path}: a row does not start with [CLS]")
        tokens = int((ids != pad).sum())
        if tokens != entry["tokens"]:
            problems.append(f"{path}: {tokens} tokens, the manifest says {entry['tokens']}")
    return problems


def decode_samples(data_dir: str | os.PathLike, tokenizer: str | os.PathLike, n: int,
                   split: str = "train", seed: int = 0) -> list[tuple[str, str]]:
    """n rows picked at random (fixed seed) decoded back to text: [(language, text)]."""
    from megatron_rembert.prep.tokenizer import load_sentencepiece

    sp = load_sentencepiece(tokenizer)
    ds = ShardDataset(data_dir, split, tokenizer_sha256=sha256_file(tokenizer))
    total = len(ds)
    if total == 0:
        return []
    picks = np.sort(np.random.default_rng(seed).choice(total, min(n, total), replace=False))
    counts = np.array([ds.rows_per_language[x] for x in ds.languages])
    lang = np.searchsorted(np.cumsum(counts), picks, side="right")
    row = picks - (np.cumsum(counts) - counts)[lang]
    rows = ds.get(lang, row)
    return [(ds.languages[li], sp.decode(r.tolist())) for li, r in zip(lang, rows, strict=True)]
