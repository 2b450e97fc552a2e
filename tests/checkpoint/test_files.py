"""Guarded torch loads: memory-mapped where the file's format allows it, decided from the file
before the load (never from an error's message)."""

import pytest
import torch

from megatron_rembert.checkpoint import CheckpointError, files


@pytest.mark.parametrize("zip_format", [True, False])
def test_both_torch_formats_load_memory_mapped_where_possible(tmp_path, monkeypatch, zip_format):
    path = tmp_path / "states.pt"
    saved = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": 7}
    torch.save(saved, path, _use_new_zipfile_serialization=zip_format)
    asked = []
    real_load = torch.load

    def load(*args, mmap=None, **kwargs):
        asked.append(mmap)
        return real_load(*args, mmap=mmap, **kwargs)

    monkeypatch.setattr(files.torch, "load", load)
    got = files.torch_load_weights(path)
    assert torch.equal(got["w"], saved["w"]) and got["step"] == 7
    # One load: memory-mapped for the zip format, read for the legacy one (which torch
    # refuses to map); never a failed first try.
    assert asked == [zip_format]


def test_truncated_files_of_either_format_name_the_file(tmp_path):
    for zip_format in (True, False):
        path = tmp_path / f"states_{zip_format}.pt"
        torch.save({"w": torch.ones(64)}, path, _use_new_zipfile_serialization=zip_format)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        with pytest.raises(CheckpointError, match=rf"{path.name}: unreadable"):
            files.torch_load_weights(path)
