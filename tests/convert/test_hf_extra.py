"""Without the `hf` extra, converting with a tokenizer fails at once with the install line."""

import sys
from pathlib import Path

import pytest

from megatron_rembert.convert.files import ConvertError
from megatron_rembert.convert.tokenizer_files import check_tokenizer


def test_missing_tokenizers_library_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises
    with pytest.raises(ConvertError, match=r"tokenizers.*megatron-rembert\[hf\]"):
        check_tokenizer(Path(tmp_path / "spm.model"), 1000, None)
