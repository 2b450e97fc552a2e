"""Fused kernels: Triton on CUDA, torch reference on CPU; no process groups in here."""

from megatron_rembert.kernels.cross_entropy import linear_cross_entropy
from megatron_rembert.kernels.softmax import fused_scale_mask_softmax

__all__ = ["fused_scale_mask_softmax", "linear_cross_entropy"]
