"""The fixed-order reductions in plain XLA ops (the ``"cpu"`` implementation, and the
cumulative reductions on every device).

Sums and products (``reduce_rows``, from ``pallas/fixed_order.py``; the same order as
``pallas/reduce_triton.py``, bit for bit):
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

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels.pallas.fixed_order import Combine
from jaxrl_kernels.pallas.fixed_order import pad_to_tiles as pad_to_tiles
from jaxrl_kernels.pallas.fixed_order import reduce_rows as reduce_rows
from jaxrl_kernels.pallas.fixed_order import state_dtype as state_dtype


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
  tiles = pad_to_tiles(x.astype(dt), lanes, identity)  # [R, nt, L]
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
