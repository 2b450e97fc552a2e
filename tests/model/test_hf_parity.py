"""Our RemBERT against transformers' RemBertForMaskedLM with the same weights."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rembert.convert.hf import from_hf_state_dict, hf_config_dict, to_hf_state_dict
from megatron_rembert.model.mlm_head import gather_positions
from megatron_rembert.model.rembert import RemBertForPreTraining
from tests.model.helpers import random_batch, small_config

transformers = pytest.importorskip("transformers")


def _hf_model(config):
    torch.manual_seed(0)
    hf = transformers.RemBertForMaskedLM(transformers.RemBertConfig(**hf_config_dict(config)))
    with torch.no_grad():  # move every weight off its init value, LayerNorms included
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf.eval()


@pytest.mark.parametrize("loss_backend, attention_backend", [
    ("reference", "sdpa"), ("fused", "sdpa"), ("fused", "fused_softmax")])
def test_same_hidden_states_logits_and_loss(loss_backend, attention_backend):
    config = small_config(loss_backend=loss_backend, attention_backend=attention_backend)
    hf = _hf_model(config)
    ours = RemBertForPreTraining(config).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), config))
    batch = random_batch(config)

    labels = torch.full_like(batch["input_ids"], -100)
    labels.scatter_(1, batch["masked_positions"],
                    batch["masked_labels"].masked_fill(batch["masked_weights"] == 0, -100))
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 token_type_ids=batch["token_type_ids"], labels=labels,
                 output_hidden_states=True)
        states = ours.rembert(batch["input_ids"], batch["attention_mask"],
                              batch["token_type_ids"], output_hidden_states=True)
        assert len(states) == len(ref.hidden_states) == config.num_hidden_layers + 1
        for layer, (a, b) in enumerate(zip(states, ref.hidden_states, strict=True)):
            assert (a - b).abs().max() <= 1e-5, f"hidden states differ after layer {layer}"

        masked = gather_positions(states[-1], batch["masked_positions"])
        logits = ours.mlm_head.logits(masked)[:, : config.vocab_size]
        ref_logits = gather_positions(ref.logits, batch["masked_positions"])
        assert (logits - ref_logits).abs().max() <= 1e-5

        out = ours(**batch)
    assert out.num_tokens.item() == 14
    torch.testing.assert_close(out.loss_sum / out.num_tokens, ref.loss, atol=1e-5, rtol=1e-5)
    keep = batch["masked_weights"].reshape(-1) > 0
    expected_correct = (ref_logits.argmax(-1) == batch["masked_labels"].reshape(-1))[keep].sum()
    assert out.num_correct.item() == expected_correct.item()


def test_state_dict_round_trip_is_exact():
    config = small_config()
    hf = _hf_model(config)
    ours = from_hf_state_dict(hf.state_dict(), config)
    assert ours["mlm_head.decoder.weight"].shape[0] == config.padded_vocab_size(1) == 384
    assert ours["mlm_head.decoder.weight"][config.vocab_size:].abs().sum() == 0
    back = to_hf_state_dict(ours, config)
    expected = hf.state_dict()
    assert back.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def test_padded_vocabulary_takes_no_probability_mass():
    config = small_config(loss_backend="reference")
    model = RemBertForPreTraining(config)
    model.init_weights(seed=1)
    with torch.no_grad():  # make the padding columns the largest logits by far
        model.mlm_head.decoder.bias[config.vocab_size:] = 1e4
    batch = random_batch(config)
    out = model(**batch)
    hidden = gather_positions(model.rembert(batch["input_ids"], batch["attention_mask"],
                                            batch["token_type_ids"]), batch["masked_positions"])
    logits = model.mlm_head.logits(hidden)[:, : config.vocab_size]
    per_token = F.cross_entropy(logits, batch["masked_labels"].reshape(-1), reduction="none")
    expected = (per_token * batch["masked_weights"].reshape(-1)).sum()
    torch.testing.assert_close(out.loss_sum, expected, atol=1e-4, rtol=1e-5)
