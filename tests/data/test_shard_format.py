"""Shards are Arrow IPC streams: `datasets`, pandas and pyarrow read them as they are, and
shards of older datasets (the IPC file format) still load."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest

from megatron_rembert.data.shards import ShardDataset, open_shard, read_shard_batches
from megatron_rembert.fs import sha256_file
from tests.data.conftest import SEQ, shard_entries


def test_shards_load_in_datasets_and_pandas(dataset):
    datasets = pytest.importorskip("datasets")
    entry = shard_entries(dataset)[0]
    path = dataset / entry["file"]
    ours = open_shard(path, entry, SEQ)
    hf = datasets.Dataset.from_file(str(path))
    assert hf.column_names == ["input_ids", "lang"] and len(hf) == entry["rows"]
    np.testing.assert_array_equal(np.array(hf["input_ids"], dtype=np.int32), ours)
    assert set(hf["lang"]) == {entry["language"]}
    frame = pa.ipc.open_stream(str(path)).read_pandas()
    np.testing.assert_array_equal(np.stack(frame["input_ids"].to_numpy()), ours)


def test_shards_of_the_file_format_still_load(dataset, tmp_path):
    old = tmp_path / "ds"
    shutil.copytree(dataset, old)
    manifest = json.loads((old / "manifest.json").read_text())
    for entry in manifest["shards"]:  # rewrite every shard as an IPC file, as datasets were
        path = old / entry["file"]
        schema, batches = read_shard_batches(path, mmap=False)
        table = pa.Table.from_batches(batches, schema)
        with pa.ipc.new_file(str(path), schema) as writer:
            writer.write_table(table)
        assert path.read_bytes()[:6] == b"ARROW1"
        entry.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    (old / "manifest.json").write_text(json.dumps(manifest))
    for split in ("train", "valid"):
        new_rows, old_rows = ShardDataset(dataset, split), ShardDataset(old, split)
        assert len(new_rows) == len(old_rows) > 0
        for (lang_a, a), (lang_b, b) in zip(new_rows.iter_rows(), old_rows.iter_rows(),
                                            strict=True):
            assert lang_a == lang_b
            np.testing.assert_array_equal(a, b)
