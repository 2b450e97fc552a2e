"""Dropout 0.1 under tensor and pipeline parallelism, through train.py's loop (tp2 x pp2).

TP peers must draw the same masks for replicated activations (else their replicated weights
drift apart) and different ones for their own attention heads; pipeline stages must not share
a stream (Megatron offsets the seed by 100 x stage), or layer 0 on stage 0 and layer 1 on
stage 1 drop exactly the same attention probabilities.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.production import _masters_and_momentum, as_sets, data_overrides

pytestmark = pytest.mark.multiprocess  # every test here starts processes

DROPOUT = {"model.hidden_dropout_prob": 0.1, "model.attention_probs_dropout_prob": 0.1,
           "parallel.tp": 2, "parallel.pp": 2, "model.num_hidden_layers": 2}


def _digest(state: torch.Tensor) -> str:
    return hashlib.sha1(state.numpy().tobytes()).hexdigest()


def _train_with_dropout(rank, world_size, sets):
    """Per rank: the RNG streams each Transformer layer starts its first forward with, and the
    replicated weights after training."""

    from megatron_rembert.model import transformer
    from megatron_rembert.parallel import random as tp_random
    from megatron_rembert.parallel.layers import is_tp_sharded
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training import engine, loop
    from megatron_rembert.training.full_tensors import local_parameters

    streams, trainers = {}, []
    real_forward, real_init = transformer.TransformerLayer.forward, engine.Trainer.__init__

    def forward(self, x, key_mask):
        if self.training and self.pipe_prefix not in streams:
            streams[self.pipe_prefix] = (_digest(torch.get_rng_state()),
                                         _digest(tp_random._tp_states["cpu"]))
        return real_forward(self, x, key_mask)

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        trainers.append(self)

    transformer.TransformerLayer.forward = forward
    engine.Trainer.__init__ = init
    loop.train(load_config("configs/tiny.yaml", sets))
    masters = _masters_and_momentum(trainers[0], with_momentum=False)[0]
    replicated = {name: masters[name] for name, p in local_parameters(trainers[0].engine.module)
                  if not is_tp_sharded(p)}
    return streams, replicated


@pytest.fixture(scope="module")
def dropout_run(tiny_dataset, tmp_path_factory):
    sets = {**data_overrides(*tiny_dataset, tmp_path_factory.mktemp("dropout"), 2), **DROPOUT}
    return run_distributed(_train_with_dropout, 4, as_sets(sets), timeout=600)


def test_tp_peers_share_the_replicated_stream_not_the_head_stream(dropout_run):
    for stage in (0, 1):  # ranks (2 * stage, 2 * stage + 1) are TP peers
        (streams_a, weights_a), (streams_b, weights_b) = dropout_run[2 * stage:2 * stage + 2]
        assert streams_a.keys() == streams_b.keys() and streams_a
        for layer, (default_a, tp_a) in streams_a.items():
            default_b, tp_b = streams_b[layer]
            assert default_a == default_b, layer  # residual and embedding dropout agree
            assert tp_a != tp_b, layer  # each rank's attention heads drop their own units
        # What a wrong replicated mask would break: the replicated weights stay identical.
        assert weights_a.keys() == weights_b.keys() and weights_a
        for name, w in weights_a.items():
            assert torch.equal(w, weights_b[name]), name


def test_pipeline_stages_draw_different_masks(dropout_run):
    first, second = dropout_run[0][0], dropout_run[2][0]  # tp rank 0 of stages 0 and 1
    assert set(first) == {"rembert.layers.0."} and set(second) == {"rembert.layers.1."}
    (default_0, tp_0), (default_1, tp_1) = first["rembert.layers.0."], second["rembert.layers.1."]
    assert tp_0 != tp_1 and default_0 != default_1
