"""Fixed-order row sums and products in plain XLA ops, the bits of ``pallas/reduce_triton.py``.

Lane ``j`` of ``lanes`` accumulates ``x[j], x[j + L], x[j + 2L], ...`` in ascending order,
then the lanes fold in halves. Each addition is a separate XLA op on whole arrays, so no
fusion can reassociate it. Kernel-level: used by ``reduce/`` and by the attention kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

Combine = Callable[[jax.Array, jax.Array], jax.Array]

# Tile counts up to this are walked by unrolled ops; longer axes by a fori_loop
# (the same additions in the same order either way).
UNROLL_TILES = 16


def state_dtype(dtype) -> jnp.dtype:
  """float32 state for 16-bit inputs; float32/float64 keep their own."""
  return jnp.promote_types(dtype, jnp.float32)


def pad_to_tiles(x: jax.Array, lanes: int, identity: float) -> jax.Array:
  n = x.shape[-1]
  n_pad = -(-max(n, 1) // lanes) * lanes
  if n_pad != n:
    pad = [(0, 0)] * (x.ndim - 1) + [(0, n_pad - n)]
    x = jnp.pad(x, pad, constant_values=identity)
  return x.reshape(*x.shape[:-1], n_pad // lanes, lanes)


def reduce_rows(x: jax.Array, *, op: str, lanes: int, out_dtype) -> jax.Array:
  """``[R, N] -> [R]``: lane-strided ascending accumulation, then a halving fold."""
  combine: Combine = jnp.add if op == "sum" else jnp.multiply
  identity = 0.0 if op == "sum" else 1.0
  dt = state_dtype(x.dtype)
  if x.shape[-1] <= lanes:
    # One lane step: lane j holds identity (+) x[j] for j < N and the identity past N.
    # The halving fold adds those identities to values that are never -0.0 (0.0 + x
    # is not -0.0, nor is a sum of such values), which leaves them unchanged; so the
    # fold may start at the first power of two >= N, on an array of that width only
    # (a row of one element, a sum over a size-1 axis, costs one elementwise op).
    lanes = 1 << (max(x.shape[-1], 1) - 1).bit_length()
  tiles = pad_to_tiles(x.astype(dt), lanes, identity)  # [R, nt, L]
  nt = tiles.shape[1]
  # The kernel's first step, identity (+) x, written so that XLA cannot simplify it to
  # x: 0.0 + (-0.0) is +0.0 (a product's 1.0 * x is x exactly).
  first = tiles[:, 0, :]
  acc = jnp.where(first == 0, jnp.zeros((), dt), first) if op == "sum" else first
  if nt <= UNROLL_TILES:
    for t in range(1, nt):
      acc = combine(acc, tiles[:, t, :])
  else:
    acc = lax.fori_loop(1, nt, lambda t, a: combine(a, tiles[:, t, :]), acc)
  width = lanes
  while width > 1:
    lo, hi = jnp.split(acc, 2, axis=1)
    acc = combine(lo, hi)
    width //= 2
  return acc.reshape(x.shape[0]).astype(out_dtype)
