"""Causal grouped-query attention whose bits do not depend on decode vs prefill."""

from jaxrl_kernels.attention.api import causal_attention
from jaxrl_kernels.contract import ATTENTION_TRITON_BLOCK_Q as BLOCK_Q
from jaxrl_kernels.contract import ATTENTION_TRITON_KEY_TILE as KEY_TILE

__all__ = ["BLOCK_Q", "KEY_TILE", "causal_attention"]
