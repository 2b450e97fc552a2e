"""The micro-batch schema (data/batch.py): what masking builds, the trainer's check and the
pipeline's input tuple all follow the one definition."""

import numpy as np
import pytest
import torch

from megatron_rembert.data import batch
from megatron_rembert.data.masking import MaskingConfig, mask_batch
from megatron_rembert.model.pipeline import PIPE_INPUTS, pipeline_inputs


def _masked(rows: int = 3, seq: int = 16, predictions: int = 4, pad_last: bool = True) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 100, size=(rows, seq)).astype(np.int32)
    ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
    if pad_last:
        ids[-1, seq // 2:] = 0
    cfg = MaskingConfig(vocab_size=100, max_predictions=predictions)
    return mask_batch(ids, np.arange(rows), cfg)


def test_masking_builds_every_key_of_its_dtype_and_shape():
    b = _masked()
    assert list(b) == list(batch.KEYS)
    for key, value in b.items():
        assert value.dtype == batch.FIELDS[key].dtype, key
        assert value.shape == batch.shape(key, 3, 16, 4), key
    assert b["unpadded"].tolist() == [0] and _masked(pad_last=False)["unpadded"].tolist() == [1]
    batch.check_micro_batch(b)  # numpy arrays
    batch.check_micro_batch({k: torch.from_numpy(v) for k, v in b.items()})  # torch tensors


@pytest.mark.parametrize("change, message", [
    (lambda b: b.pop("token_type_ids"), "keys"),
    (lambda b: b.update(attention_mask=b["attention_mask"].astype(np.float32)),
     "attention_mask is float32, expected int64"),
    (lambda b: b.update(masked_weights=b["masked_weights"].astype(np.float64)),
     "masked_weights is float64, expected float32"),
    (lambda b: b.update(masked_labels=b["masked_labels"][:, :3]),
     r"masked_labels has shape \(3, 3\), expected \(3, 4\)"),
    (lambda b: b.update(unpadded=np.ones(1, np.int64)), "unpadded is 1 but attention_mask"),
], ids=["missing-key", "float-mask", "double-weights", "narrow-labels", "lying-flag"])
def test_check_names_what_is_wrong(change, message):
    b = _masked()
    change(b)
    with pytest.raises(ValueError, match=f"micro-batch 5: {message}" if message != "keys"
                       else "micro-batch 5: keys"):
        batch.check_micro_batch(b, "micro-batch 5")


def test_pipeline_inputs_are_the_device_keys_as_integers():
    """The first stage's tuple holds every device key of the batch, in order, none of them a
    float (DeepSpeed would wait for its gradient); the host flag stays out."""
    b = {k: torch.from_numpy(v) for k, v in _masked().items()}
    inputs = pipeline_inputs(b)
    assert len(inputs) == len(batch.KEYS) - len(batch.HOST_KEYS) == len(PIPE_INPUTS)
    assert "unpadded" not in PIPE_INPUTS
    for key, value in zip(PIPE_INPUTS, inputs, strict=True):
        assert not value.is_floating_point(), key
        if key != "masked_weights":
            assert torch.equal(value, b[key]), key
    assert torch.equal(inputs[PIPE_INPUTS.index("masked_weights")].view(torch.float32),
                       b["masked_weights"])
