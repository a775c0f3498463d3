"""Row scatter-adds in a fixed order: the gradient of an embedding lookup, run to run the same.

XLA's GPU scatter adds updates whose indices repeat with atomics, in whatever order the
threads arrive: the gradient of ``jnp.take(table, ids, axis=0)`` (every token of a batch
adds its row's cotangent to its id's row) changes its last bits from run to run.
:func:`segment_rows_add` orders the updates by a stable sort of the ids, sums each id's
updates with a fixed ``associative_scan`` tree and scatters the totals once, to unique rows;
:func:`take_rows` is ``jnp.take(table, ids, axis=0)`` with that gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def segment_rows_add(operand: jax.Array, ids: jax.Array, updates: jax.Array) -> jax.Array:
  """``operand[ids[i]] += updates[i]`` for rows of ``operand``, in a fixed order.

  Args:
    operand: ``[R, ...]``.
    ids: ``[n]`` int row ids; ids outside ``[0, R)`` are dropped.
    updates: ``[n, ...]`` rows (``operand.shape[1:]``).

  Returns:
    ``operand`` with each id's updates added: the updates of one id summed in float32 (or
    wider) by a fixed tree over their order in ``ids`` (a stable sort keeps it), then added
    once. The bits depend on the ids and the updates only.
  """
  n = ids.shape[0]
  if n == 0:
    return operand
  order = jnp.argsort(ids, stable=True)
  sidx = ids[order]
  supd = updates[order].astype(jnp.promote_types(updates.dtype, jnp.float32))
  start = jnp.concatenate([jnp.ones((1,), bool), sidx[1:] != sidx[:-1]])
  last = jnp.concatenate([sidx[1:] != sidx[:-1], jnp.ones((1,), bool)])

  def seg_add(a, b):
    fa, va = a
    fb, vb = b
    keep = fb.reshape(fb.shape + (1,) * (vb.ndim - 1))
    return fa | fb, jnp.where(keep, vb, va + vb)

  _, sums = lax.associative_scan(seg_add, (start, supd))
  # Non-final entries of a segment go to distinct rows past the end: dropped.
  target = jnp.where(last, sidx, operand.shape[0] + jnp.arange(n, dtype=sidx.dtype))
  dn = lax.ScatterDimensionNumbers(update_window_dims=tuple(range(1, updates.ndim)),
                                   inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,))
  return lax.scatter_add(operand, target[:, None], sums.astype(operand.dtype), dn,
                         unique_indices=True, mode=lax.GatherScatterMode.FILL_OR_DROP)


@jax.custom_vjp
def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
  """``jnp.take(table, ids, axis=0)`` (ids in ``[0, R)``; the forward's bits), whose
  gradient w.r.t. ``table`` is :func:`segment_rows_add` of the cotangent rows: run to run
  the same bits on every backend."""
  return jnp.take(table, ids, axis=0)


def _take_rows_fwd(table, ids):
  # The table's row count and dtype, as an empty array (residuals are arrays).
  return take_rows(table, ids), (ids, jnp.zeros((table.shape[0], 0), table.dtype))


def _take_rows_bwd(res, g):
  ids, like = res
  flat = ids.reshape(-1)
  trailing = g.shape[ids.ndim:]
  upd = g.reshape((flat.shape[0],) + trailing)
  zeros = jnp.zeros((like.shape[0],) + trailing, like.dtype)
  return segment_rows_add(zeros, flat, upd), None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)
