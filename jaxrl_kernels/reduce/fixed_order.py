"""The fixed-order reductions in plain XLA ops (the ``"cpu"`` implementation, and the
cumulative reductions on every device).

Sums and products (the same order as ``pallas/reduce_triton.py``, bit for bit):
lane ``j`` of ``REDUCE_LANES`` accumulates ``x[j], x[j + L], x[j + 2L], ...`` in
ascending order, then the lanes fold in halves. Each addition is a separate XLA
op on whole arrays, so no fusion can reassociate it.

Cumulative reductions (``cumsum``, ``cumprod``, ``cumlogsumexp``): the axis is
cut into tiles of ``L`` from index 0; inside a tile the prefix runs one element
after the other; tile totals are carried across tiles in ascending order, and
``out[i] = carry(tile of i) (+) prefix_in_tile(i)``. Element ``i`` depends only
on elements ``<= i`` and their positions, never on what follows or on the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

Combine = Callable[[jax.Array, jax.Array], jax.Array]

# Tile counts up to this are walked by unrolled ops; longer axes by a fori_loop
# (the same additions in the same order either way).
_UNROLL_TILES = 16


def state_dtype(dtype) -> jnp.dtype:
  """float32 state for 16-bit inputs; float32/float64 keep their own."""
  return jnp.promote_types(dtype, jnp.float32)


def _pad_to_tiles(x: jax.Array, lanes: int, identity: float) -> jax.Array:
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
  tiles = _pad_to_tiles(x.astype(dt), lanes, identity)  # [R, nt, L]
  nt = tiles.shape[1]
  # The kernel's first step, identity (+) x, written so that XLA cannot simplify it to
  # x: 0.0 + (-0.0) is +0.0 (a product's 1.0 * x is x exactly).
  first = tiles[:, 0, :]
  acc = jnp.where(first == 0, jnp.zeros((), dt), first) if op == "sum" else first
  if nt <= _UNROLL_TILES:
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


def _logaddexp(a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.logaddexp(a, b)


_CUMULATIVE: dict[str, tuple[Combine, float]] = {
    "cumsum": (jnp.add, 0.0),
    "cumprod": (jnp.multiply, 1.0),
    "cumlogsumexp": (_logaddexp, -jnp.inf),
}


def cumulative_rows(x: jax.Array, *, op: str, lanes: int) -> jax.Array:
  """``[R, N] -> [R, N]`` inclusive prefix of ``op`` in the tiled fixed order."""
  combine, identity = _CUMULATIVE[op]
  rows, n = x.shape
  dt = state_dtype(x.dtype)
  tiles = _pad_to_tiles(x.astype(dt), lanes, identity)  # [R, nt, L]
  nt = tiles.shape[1]

  def step(carry, col):  # one element after the other inside every tile
    out = combine(carry, col)
    return out, out

  cols = jnp.moveaxis(tiles, 2, 0)  # [L, R, nt]
  first = cols[0]
  _, rest = lax.scan(step, first, cols[1:])
  local = jnp.concatenate([first[None], rest], axis=0)  # [L, R, nt]
  totals = local[-1]  # [R, nt]

  def carry_step(c, tot):  # exclusive carry of tile totals, ascending
    return combine(c, tot), c

  _, carries = lax.scan(carry_step, totals[:, 0], jnp.moveaxis(totals[:, 1:], 1, 0))
  # tile 0 takes its local prefix as is; tile t > 0 adds the carry of tiles < t
  later = combine(jnp.moveaxis(carries, 0, 1)[None], local[:, :, 1:])  # [L, R, nt-1]
  out = jnp.concatenate([local[:, :, :1], later], axis=2)
  out = jnp.moveaxis(out, 0, 2).reshape(rows, nt * lanes)[:, :n]
  return out.astype(x.dtype)
