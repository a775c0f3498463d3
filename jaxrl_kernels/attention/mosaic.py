"""``implementation="mosaic"``: ``pallas/attention_mosaic.py`` (Hopper, bf16/fp16).

The forward is the Mosaic GPU kernel (``contract.ATTENTION_MOSAIC_BLOCK_Q``
query rows per warpgroup, ``ATTENTION_MOSAIC_KEY_TILE`` keys per tile: its own
bits, not the Triton kernel's). It writes the Triton forward's residual format
(base-2 logsumexp). The backward runs the Mosaic GPU kernels of
``pallas/attention_mosaic_bwd.py`` (dK/dV and dQ) on that residual.
"""

from __future__ import annotations

import functools

from jaxrl_kernels.attention.base import AttentionBackend
from jaxrl_kernels.pallas import attention_mosaic, attention_mosaic_bwd

BACKEND = AttentionBackend(
    "mosaic",
    forward=attention_mosaic.forward,
    backward=attention_mosaic_bwd.backward,
    supported=attention_mosaic.supported,
    forward_heads_major=functools.partial(attention_mosaic.forward, heads_major=True))
