"""Optimizer state created by our code lives where torch would put it: on the parameter's
device, in torch's dtypes (fused AdamW on CUDA refuses a CPU `step`)."""

import torch

from megatron_rembert.training.full_tensors import init_adam_state


def test_portable_adam_state_matches_torchs_own():
    param = torch.nn.Parameter(torch.randn(3, 4))
    optimizer = torch.optim.AdamW([param], fused=True)
    param.grad = torch.randn(3, 4)
    optimizer.step()
    ours = {}
    init_adam_state(ours, param, 1)
    theirs = optimizer.state[param]
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert (ours[key].dtype, ours[key].shape, ours[key].device) == \
            (value.dtype, value.shape, value.device), key


def test_portable_adam_state_follows_the_parameter_device():
    param = torch.empty(3, 4, device="meta")  # stands for a CUDA parameter: not the CPU
    state = {}
    init_adam_state(state, param, 7)
    assert {v.device for v in state.values()} == {param.device}
