"""transformers tokenizer files built from our SentencePiece unigram model.

transformers' own `RemBertTokenizer` hard-codes the released RemBERT's special-token ids
(unknown token at id 2), which our vocabularies do not share; so the export writes a
`tokenizer.json` (the `tokenizers` library's Unigram with the model's own pieces, scores,
unknown id and normalisation table) loaded by `AutoTokenizer` as a fast tokenizer, plus the
original `sentencepiece.model`. Ids equal SentencePiece's, with [CLS] ... [SEP] around them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from megatron_rembert.convert.files import ConvertError
from megatron_rembert.data.common import SPECIAL_PIECES
from megatron_rembert.fs import sha256_file

HF_EXTRA_HINT = "pip install 'megatron-rembert[hf]' (in a clone: pip install -e '.[hf]')"


def _require_tokenizers() -> None:
    try:
        import tokenizers  # noqa: F401
    except ImportError as err:
        raise ConvertError(f"writing transformers tokenizer files needs the `tokenizers` "
                           f"library: {HF_EXTRA_HINT}") from err


def check_tokenizer(path: Path, vocab_size: int, expected_sha: str | None,
                    allow_fewer: bool = False) -> None:
    """allow_fewer: the checkpoint was trained with data.allow_larger_vocab (a tokenizer with
    fewer pieces than the model's vocabulary rows)."""
    _require_tokenizers()  # before any weight is converted
    if not path.is_file():
        raise ConvertError(f"--tokenizer {path}: no such file")
    if expected_sha and sha256_file(path) != expected_sha:
        raise ConvertError(f"--tokenizer {path}: its sha256 differs from the tokenizer the "
                           "checkpoint was trained with (meta.json tokenizer_sha256); pass the "
                           "training tokenizer")
    import sentencepiece as spm

    try:
        size = spm.SentencePieceProcessor(model_file=str(path)).get_piece_size()
    except (RuntimeError, OSError) as err:
        raise ConvertError(f"--tokenizer {path}: not a SentencePiece model ({err})") from err
    if size != vocab_size and not (allow_fewer and size < vocab_size):
        raise ConvertError(f"--tokenizer {path}: {size} pieces, the model's vocab_size is "
                           f"{vocab_size}")


def write_tokenizer(spm_path: Path, out: Path, max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and sentencepiece.model into `out`."""
    from sentencepiece import sentencepiece_model_pb2

    _require_tokenizers()
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(spm_path.read_bytes())
    pieces = [(p.piece, p.score) for p in proto.pieces]
    ids = {p: i for i, (p, _) in enumerate(pieces)}
    missing = [p for p in SPECIAL_PIECES.values() if p not in ids]
    if missing:
        raise ConvertError(f"--tokenizer {spm_path}: no special pieces {missing}; train it "
                           "with data_tools/train_tokenizer.py")
    tok = Tokenizer(Unigram(pieces, unk_id=proto.trainer_spec.unk_id,
                            byte_fallback=proto.trainer_spec.byte_fallback))
    steps = []
    if proto.normalizer_spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap))
    if proto.normalizer_spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    tok.normalizer = normalizers.Sequence(steps)
    scheme = "always" if proto.normalizer_spec.add_dummy_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    tok.add_special_tokens(list(SPECIAL_PIECES.values()))
    cls, sep = SPECIAL_PIECES["cls"], SPECIAL_PIECES["sep"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, ids[cls]), (sep, ids[sep])])
    tok.save(str(out / "tokenizer.json"))
    shutil.copyfile(spm_path, out / "sentencepiece.model")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              **{f"{k}_token": v for k, v in SPECIAL_PIECES.items()}}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
