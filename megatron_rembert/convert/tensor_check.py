"""The one check of what a conversion reads: every stored tensor against the model's parameters.

Every converter (from-hf of a transformers folder; to-hf, export-encoder, reshard and average
of a checkpoint) lists what its input files hold, from headers and memory-mapped pickles
without reading any data (`StoredTensor`), and passes it here with the shapes the config's
model expects, before anything is written. Whatever does not fit is refused in one line
naming the file and the tensor, never converted:
- an extra tensor (a config.json or meta.json that says fewer layers than the files hold
  would otherwise drop those layers without a word);
- a missing tensor;
- an integer, quantised, float64 or other unexpected dtype (casting an int8 weight to float
  would train from nonsense; float64 is not a dtype anything here writes or trains in);
- a shape other than the model's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping

from megatron_rembert.checkpoint.files import StoredTensor
from megatron_rembert.checkpoint.reader import CheckpointReader
from megatron_rembert.convert.files import ConvertError

# The dtypes a weight (or an Adam moment) may be stored in: what training holds.
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


def _more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def check_tensors(found: Mapping[Hashable, StoredTensor],
                  expected: Mapping[Hashable, tuple[int, ...]], model_source: str,
                  label: Callable[[Hashable], str] = str) -> None:
    """Raise ConvertError naming the first tensor that is extra, missing, of an unexpected
    dtype or of the wrong shape. `found` and `expected` share their keys (a name, or a name
    and TP rank); `model_source` is the file the model config comes from; `label(key)` names a
    missing tensor."""
    extra = [k for k in found if k not in expected]
    if extra:
        t = found[extra[0]]
        raise ConvertError(f"{t.file}: tensor {t.name}{_more(extra)} is not a parameter of the "
                           f"model {model_source} describes; refusing to drop it (the config "
                           "or the file is wrong)")
    missing = [k for k in expected if k not in found]
    if missing:
        raise ConvertError(f"{model_source}: the model needs tensor {label(missing[0])}"
                           f"{_more(missing)}, which the files do not hold")
    for key, shape in expected.items():
        t = found[key]
        if t.dtype not in WEIGHT_DTYPES:
            raise ConvertError(f"{t.file}: tensor {t.name} has dtype {t.dtype}; weights must "
                               f"be {', '.join(WEIGHT_DTYPES)} (an integer or quantised "
                               "tensor is not converted to float)")
        if tuple(t.shape) != tuple(shape):
            raise ConvertError(f"{t.file}: tensor {t.name} has shape {tuple(t.shape)}, the "
                               f"model {model_source} describes needs {tuple(shape)}")


def check_checkpoint(reader: CheckpointReader) -> None:
    """A checkpoint's files against its meta.json's model: a portable checkpoint's full
    tensors and, when stored, its Adam moments; the trainer's shard files' masters, by the
    size of each parameter's fragments per TP rank (they are its weights)."""
    source = str(reader.folder / "meta.json")
    if reader.portable:
        keys = [""] if reader.weights_only else ["", "exp_avg/", "exp_avg_sq/"]
        expected = {(k + s.name, 0): s.shape for s in reader.specs for k in keys}
        check_tensors(reader.stored_weights(), expected, source, lambda key: key[0])
        return
    sizes = {(s.name, rank): (math.prod(s.local_shape(reader.tp)),) for s in reader.specs
             for rank in range(reader.tp)}
    check_tensors(reader.stored_optimizer(), sizes, source,
                  lambda key: f"{key[0]} (TP rank {key[1]})")
