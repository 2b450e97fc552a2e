"""The shard reader: zero-copy maps, and a clear error naming the file for every mismatch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rembert.data.common import DataError
from megatron_rembert.data.shards import ShardDataset, write_shard
from megatron_rembert.fs import sha256_file
from megatron_rembert.prep.inspection import verify
from tests.data.conftest import set_token, shard_entries

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def copy(dataset, tmp_path) -> Path:
    d = tmp_path / "ds"
    shutil.copytree(dataset, d)
    return d


def _first_shard(d: Path) -> Path:
    return d / json.loads((d / "manifest.json").read_text())["shards"][0]["file"]


def test_reader_is_zero_copy_and_checks_hash(dataset, tokenizer):
    ds = ShardDataset(dataset, tokenizer_sha256=sha256_file(tokenizer), seq_length=64)
    arr = ds._arrays[ds.languages[0]][0]
    assert arr.dtype == np.int32 and not arr.flags.owndata and not arr.flags.writeable
    assert len(ds) == sum(ds.rows_per_language.values()) > 0
    assert verify(dataset, tokenizer) == []


def test_other_tokenizer_is_rejected(dataset):
    with pytest.raises(DataError, match=r"manifest\.json.*another tokenizer|tokenizer sha256"):
        ShardDataset(dataset, tokenizer_sha256="0" * 64)


def test_sequence_length_mismatch(dataset):
    with pytest.raises(DataError, match="sequence length 64.*128"):
        ShardDataset(dataset, seq_length=128)


def test_truncated_shard_names_file(copy):
    shard = _first_shard(copy)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(DataError, match=shard.name):
        ShardDataset(copy)


@pytest.mark.multiprocess
def test_modified_shard_found_by_checksum(copy):
    shard = _first_shard(copy)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=shard.name):
        ShardDataset(copy, verify_checksums=True)
    assert any(shard.name in p for p in verify(copy))
    r = subprocess.run([sys.executable, "data_tools/inspect_shards.py", str(copy), "--verify"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and shard.name in r.stdout


def test_missing_shard_and_manifest(copy):
    shard = _first_shard(copy)
    shard.unlink()
    with pytest.raises(DataError, match=shard.name):
        ShardDataset(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(DataError, match="manifest.json not found"):
        ShardDataset(copy)


def test_schema_version_mismatch(copy):
    m = json.loads((copy / "manifest.json").read_text())
    m["schema_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="schema_version 99"):
        ShardDataset(copy)


def test_out_of_range_ids_are_reported(copy):
    m = json.loads((copy / "manifest.json").read_text())
    m["tokenizer"]["vocab_size"] = 10  # every real token is now out of range
    (copy / "manifest.json").write_text(json.dumps(m))
    assert any("outside [0, 10)" in p for p in verify(copy))


def test_every_shard_of_both_splits_is_checked_at_start_up(copy):
    """The training split's reader also checks the validation shards (one stat each), so a
    missing one is found before the model is built, not at the first validation."""
    valid = [copy / e["file"] for e in shard_entries(copy, "valid")]
    data = valid[0].read_bytes()
    valid[0].write_bytes(data[:-8])
    with pytest.raises(DataError, match=rf"{valid[0].name} has {len(data) - 8} bytes"):
        ShardDataset(copy, "train")
    valid[0].write_bytes(data)
    valid[-1].unlink()
    with pytest.raises(DataError, match=rf"{valid[-1].name} listed in the manifest is missing"):
        ShardDataset(copy, "train")


def test_out_of_range_token_names_shard_and_row(copy):
    entry = shard_entries(copy)[0]  # the first shard of its language
    shard = copy / entry["file"]
    bad = (1 << 30) + 17  # a flipped high bit
    set_token(shard, row=3, position=5, value=bad)
    ds = ShardDataset(copy)
    lang = np.full(2, ds.languages.index(entry["language"]))
    assert ds.get(lang, np.array([0, 2])).shape == (2, 64)  # other rows read fine
    with pytest.raises(DataError, match=rf"{shard.name} row 3: token id {bad} at position 5 "
                                        r"is outside the vocabulary \[0, 1000\)"):
        ds.get(lang, np.array([0, 3]))
    set_token(shard, row=3, position=5, value=-1)
    with pytest.raises(DataError, match=rf"{shard.name} row 3: token id -1"):
        ds.get(lang, np.array([3, 0]))


def test_write_shard_records_what_is_on_disk(tmp_path):
    """The entry is hashed as the file is written; it must equal a hash of the file read back,
    and the token count must leave out exactly the padding."""
    rows = np.arange(5, 5 + 3 * 16, dtype=np.int32).reshape(3, 16)
    rows[2, 9:] = 0  # a padded last row
    entry = write_shard(tmp_path / "s.arrow", rows, "xx", pad_id=0)
    path = tmp_path / "s.arrow"
    assert entry == {"rows": 3, "tokens": 3 * 16 - 7, "language": "xx",
                     "bytes": path.stat().st_size, "sha256": sha256_file(path)}
    assert [p.name for p in tmp_path.iterdir()] == ["s.arrow"]  # no temp file left
