"""The micro-batch, defined once: its keys, each key's dtype and shape, and the check the
trainer runs on every micro-batch it is given.

The masking (`masking.mask_batch`) and the loader build batches from these fields; the
pipeline's input tuple takes the order of the device keys (`DEVICE_KEYS`). Integers wherever
a value is not a real number: DeepSpeed's pipeline engine takes every floating-point tensor it
passes between stages for an activation that awaits a gradient, so a float mask would make it
wait forever.

Torch-free: the checks compare dtype names, which numpy arrays and torch tensors share
("int64", "float32").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Field:
    dtype: type  # the numpy scalar type; the torch tensor has the dtype of the same name
    dims: tuple  # "B" rows, "S" tokens per row, "P" masked slots per row, or a fixed size


# In the order of the tuple the first pipeline stage receives.
FIELDS = {
    "input_ids": Field(np.int64, ("B", "S")),  # masked: [MASK], random or kept tokens
    "attention_mask": Field(np.int64, ("B", "S")),  # 1 real token, 0 padding
    "token_type_ids": Field(np.int64, ("B", "S")),  # zeros
    "masked_positions": Field(np.int64, ("B", "P")),  # padded with 0
    "masked_labels": Field(np.int64, ("B", "P")),  # the original tokens, padded with 0
    "masked_weights": Field(np.float32, ("B", "P")),  # 1.0 a real prediction, 0.0 padding
    # [1] if attention_mask has no padding (`unpadded_flag`), then attention runs without a
    # mask (model/transformer.py); [0] otherwise
    "unpadded": Field(np.int64, (1,)),
}
KEYS = tuple(FIELDS)
# Keys the trainer reads on the host before the micro-batch runs: the model takes them as
# Python values, so that nothing between the first forward and the last backward waits for
# the device. The rest go to the device (the pipeline's input tuple, in this order).
HOST_KEYS = ("unpadded",)
DEVICE_KEYS = tuple(k for k in KEYS if k not in HOST_KEYS)


def shape(key: str, rows: int, seq_length: int, predictions: int) -> tuple[int, ...]:
    """The shape of `key` in a batch of `rows` rows of `seq_length` tokens, P = `predictions`."""
    sizes = {"B": rows, "S": seq_length, "P": predictions}
    return tuple(sizes.get(d, d) for d in FIELDS[key].dims)


def zeros(key: str, rows: int, seq_length: int, predictions: int) -> np.ndarray:
    """An array for `key` of its shape and dtype, all zeros (the padding value of every key)."""
    return np.zeros(shape(key, rows, seq_length, predictions), FIELDS[key].dtype)


def unpadded_flag(attention_mask: np.ndarray) -> np.ndarray:
    """The batch key `unpadded`: [1] if no position of the micro-batch is padding, else [0].
    Packed rows (prep/packing.py) fill the whole sequence, so it is 1 for nearly every packed
    micro-batch; the model then calls attention without a mask."""
    return np.array([int(np.asarray(attention_mask).all())], dtype=FIELDS["unpadded"].dtype)


def _dtype_name(value) -> str:
    return str(value.dtype).removeprefix("torch.")


def check_micro_batch(mb: dict, where: str = "micro-batch") -> None:
    """Raise ValueError naming `where` unless `mb` (numpy arrays or torch tensors) has exactly
    the keys of `FIELDS`, each with its dtype and shape, and an `unpadded` flag that agrees
    with its attention mask."""
    if set(mb) != set(FIELDS):
        raise ValueError(f"{where}: keys {sorted(mb)}, expected {sorted(FIELDS)}")
    for key, field in FIELDS.items():
        expected = np.dtype(field.dtype).name
        if _dtype_name(mb[key]) != expected:
            raise ValueError(f"{where}: {key} is {_dtype_name(mb[key])}, expected {expected} "
                             "(data.batch.FIELDS)")
    rows, seq_length = mb["input_ids"].shape
    predictions = mb["masked_positions"].shape[1]
    for key in FIELDS:
        expected = shape(key, rows, seq_length, predictions)
        if tuple(mb[key].shape) != expected:
            raise ValueError(f"{where}: {key} has shape {tuple(mb[key].shape)}, expected "
                             f"{expected}")
    if bool(mb["unpadded"]) and not bool(mb["attention_mask"].all()):
        raise ValueError(f"{where}: unpadded is 1 but attention_mask has padding (0s); "
                         "compute it with data.batch.unpadded_flag")
