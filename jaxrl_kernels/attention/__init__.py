"""Causal grouped-query attention whose bits do not depend on decode vs prefill."""

from jaxrl_kernels.attention.api import causal_attention as causal_attention
from jaxrl_kernels.pallas.attention_triton import BLOCK_Q as BLOCK_Q
from jaxrl_kernels.pallas.attention_triton import KEY_TILE as KEY_TILE
