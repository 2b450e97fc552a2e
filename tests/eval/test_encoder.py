"""The encoder side: step 0 is the trainer's initialisation, checkpoint weights arrive
unchanged, batching by length changes no embedding."""

import torch

from megatron_rembert.eval.embed import embed
from megatron_rembert.eval.encoder import open_checkpoint, step0_encoder
from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.parallel import state
from tests.eval.helpers import SEED, tiny_model_config, trained_like_weights


def test_step0_is_the_pretraining_models_initialisation():
    config = tiny_model_config()
    with state.offline(1):
        full = RemBertForPreTraining(config)
        full.init_weights(SEED)
    ref = full.rembert.state_dict()
    got = step0_encoder(config, SEED).state_dict()
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.equal(got[name], tensor), name
    other = step0_encoder(config, SEED + 1).state_dict()
    assert not torch.equal(other["layers.0.attention.query.weight"],
                           ref["layers.0.attention.query.weight"])


def test_checkpoint_weights_load_unchanged(checkpoint):
    source = open_checkpoint(str(checkpoint), None)  # the save folder: its latest
    assert source.step == 7 and source.seed == SEED
    model = source.load_encoder()
    written = trained_like_weights(tiny_model_config())
    got = model.state_dict()
    for name, tensor in written.items():
        if not name.startswith("rembert."):
            continue
        mine = got[name.removeprefix("rembert.")]
        assert torch.equal(mine[: tensor.shape[0]], tensor), name
        assert not mine[tensor.shape[0]:].any()  # vocabulary padding rows are zero


def test_batching_by_length_changes_no_embedding():
    model = step0_encoder(tiny_model_config(), SEED)
    gen = torch.Generator().manual_seed(0)
    seqs = [[2, *torch.randint(5, 1000, (int(n),), generator=gen).tolist(), 3]
            for n in torch.randint(1, 40, (23,), generator=gen)]
    batched = embed(model, seqs, [0, 2, 3], batch_size=5, device="cpu", pad_id=0)
    for i, seq in enumerate(seqs):
        alone = embed(model, [seq], [0, 2, 3], batch_size=1, device="cpu", pad_id=0)
        for layer in (0, 2, 3):
            assert torch.allclose(batched[layer][i], alone[layer][0], atol=1e-5), (i, layer)
