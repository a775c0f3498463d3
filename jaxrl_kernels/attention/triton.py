"""``implementation="triton"`` and ``"interpret"``: ``pallas/attention_triton.py``.

The flash-style forward (``contract.ATTENTION_TRITON_BLOCK_Q`` queries per
program, ``ATTENTION_TRITON_KEY_TILE`` keys per tile from key 0) and its
backward kernels, compiled by Triton on a CUDA GPU or run by the Pallas
interpreter on the CPU. Every float dtype; ``D`` a multiple of 16 up to 256.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jaxrl_kernels.attention.base import AttentionBackend
from jaxrl_kernels.pallas import attention_triton

DTYPES = ("bfloat16", "float16", "float32")


def supported(d: int, dtype) -> str | None:
  """None when the Triton kernels run head dim ``d`` and ``dtype``, else why not."""
  if jnp.dtype(dtype).name not in DTYPES:
    return f"dtype {jnp.dtype(dtype).name} is not one of {DTYPES}"
  if d % 16 or not 16 <= d <= attention_triton.MAX_HEAD_DIM:
    return (f"head dim {d} is not a multiple of 16 in [16, {attention_triton.MAX_HEAD_DIM}]")
  return None


def _backend(name: str, interpret: bool) -> AttentionBackend:
  return AttentionBackend(
      name,
      forward=functools.partial(attention_triton.forward, interpret=interpret),
      backward=functools.partial(attention_triton.backward, interpret=interpret),
      supported=supported)


TRITON = _backend("triton", interpret=False)
INTERPRET = _backend("interpret", interpret=True)
