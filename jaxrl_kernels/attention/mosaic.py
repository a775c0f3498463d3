"""``implementation="mosaic"``: ``pallas/attention_mosaic.py`` (Hopper, bf16/fp16).

The forward is the Mosaic GPU kernel (``contract.ATTENTION_MOSAIC_BLOCK_Q``
query rows per warpgroup, ``ATTENTION_MOSAIC_KEY_TILE`` keys per tile: its own
bits, not the Triton kernel's). It writes the Triton forward's residual format
(base-2 logsumexp), and the gradients run the compiled Triton backward kernels
on that residual.
"""

from __future__ import annotations

import functools

from jaxrl_kernels.attention.base import AttentionBackend
from jaxrl_kernels.pallas import attention_mosaic, attention_triton

BACKEND = AttentionBackend(
    "mosaic",
    forward=attention_mosaic.forward,
    backward=functools.partial(attention_triton.backward, interpret=False),
    supported=attention_mosaic.supported)
