"""The tile-aligned group layout: each expert's rows start on a row tile.

Routing gives ``A = tokens * k`` assignments, each naming an expert. They are
placed in a buffer of ``P`` rows (a static bound, see :func:`group_layout`)
grouped by expert in ascending expert order, assignments of one expert in
ascending assignment order, and every expert's group starting on a multiple of
``GROUPED_GEMM_BLOCK_M``: a row tile never mixes experts, so the grouped GEMM
computes each tile as one fixed-shape product with one expert's weight, and a
row's bits depend on its own values and its expert only (not on how many rows
the expert got, nor on where the row landed). Unused rows are zero.

An expert id outside ``[0, E)`` never takes a row: it is refused when concrete and, traced,
flagged by ``checkify`` and placed nowhere (never wrapped onto an expert, never on top of
another assignment).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_kernels import _validation
from jaxrl_kernels._backend import cdiv
from jaxrl_kernels.contract import GROUPED_GEMM_BLOCK_M


class GroupLayout(NamedTuple):
  """Where each assignment's row lives (a pytree of int32 arrays).

  Attributes:
    dest: ``[A]``: the buffer row of assignment ``a``.
    tile_expert: ``[P / GROUPED_GEMM_BLOCK_M]``: the expert of each row tile (tiles
      after the last used one name the last expert; their rows are zero).
    tile_start: ``[E]``: the first tile of each expert's group.
    tile_count: ``[E]``: the number of tiles of each expert's group (0 when unrouted).
  """

  dest: jax.Array
  tile_expert: jax.Array
  tile_start: jax.Array
  tile_count: jax.Array

  @property
  def rows(self) -> int:
    """``P``, the buffer's static row count."""
    return self.tile_expert.shape[0] * GROUPED_GEMM_BLOCK_M


def num_tiles(assignments: int, num_experts: int) -> int:
  """The static tile bound for ``assignments`` rows over ``num_experts`` groups: each
  non-empty group wastes less than one tile, and at most ``min(E, A)`` are non-empty."""
  return cdiv(assignments, GROUPED_GEMM_BLOCK_M) + min(num_experts, assignments)


def group_ranks(ids: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array]:
  """``(counts [num_groups], rank [A])`` of int32 ``ids [A]``: how many ids each group has,
  and each id's place among its group's in ascending order (a stable sort and exclusive
  sums: exact and deterministic). Ids outside ``[0, num_groups)`` are counted nowhere
  (a negative id is not wrapped onto the last group); their rank is meaningless."""
  a = ids.shape[0]
  ids = jnp.where((ids >= 0) & (ids < num_groups), ids, num_groups)
  counts = jnp.zeros((num_groups,), jnp.int32).at[ids].add(1, mode="drop")
  order = jnp.argsort(ids, stable=True)
  begin = jnp.cumsum(counts) - counts
  rank_sorted = jnp.arange(a, dtype=jnp.int32) - begin[jnp.minimum(ids[order], num_groups - 1)]
  return counts, jnp.zeros((a,), jnp.int32).at[order].set(rank_sorted, unique_indices=True)


def group_layout(expert_ids: jax.Array, num_experts: int,
                 valid: jax.Array | None = None) -> GroupLayout:
  """The layout of ``expert_ids`` (int ``[A]``, each in ``[0, num_experts)``).

  ``valid`` (bool ``[A]``, optional): assignments that take no row (their ``dest`` is
  ``rows``, out of bounds: a scatter with ``mode="drop"`` skips them, a gather with
  ``mode="fill"`` reads zeros), e.g. the empty slots of an expert-parallel exchange; their
  ids may be anything. Integer arithmetic only (a stable sort, counts, exclusive sums):
  exact and deterministic on every device.

  Raises:
    ValueError: a (valid) id outside ``[0, num_experts)`` when the ids are concrete; traced,
      ``checkify.debug_check`` reports it under ``checkify.checkify`` and the id takes no
      row, like an invalid one.
  """
  if expert_ids.ndim != 1 or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise ValueError(f"group_layout: expert_ids must be a 1-D integer array, got "
                     f"{expert_ids.dtype} {expert_ids.shape}")
  num_experts = _validation.check_int("group_layout", "num_experts", num_experts, minimum=1)
  a = expert_ids.shape[0]
  if valid is not None and (jnp.shape(valid) != (a,) or jnp.result_type(valid) != jnp.bool_):
    raise ValueError(f"group_layout: valid must be a bool array of shape ({a},) (one per "
                     f"expert id), got {jnp.result_type(valid)} {jnp.shape(valid)}")
  _validation.check_ids_in_range("group_layout", "expert_ids", expert_ids, num_experts, valid)
  bm = GROUPED_GEMM_BLOCK_M
  ids = expert_ids.astype(jnp.int32)
  ok = (ids >= 0) & (ids < num_experts)
  if valid is not None:
    ok = ok & valid
  ids = jnp.where(ok, ids, num_experts)  # sorted after every expert, counted nowhere
  counts, rank = group_ranks(ids, num_experts)
  tile_count = (counts + bm - 1) // bm
  tile_end = jnp.cumsum(tile_count)
  tile_start = tile_end - tile_count
  n_tiles = num_tiles(a, num_experts)
  clamped = jnp.minimum(ids, num_experts - 1)
  dest = jnp.where(ids < num_experts, tile_start[clamped] * bm + rank, n_tiles * bm)
  tiles = jnp.arange(n_tiles, dtype=jnp.int32)
  # A tile's expert is the number of groups that end at or before it (a compare and a sum:
  # no search loop, which on a GPU is a loop of small kernels).
  ended = jnp.sum(tile_end[None, :] <= tiles[:, None], axis=1, dtype=jnp.int32)
  tile_expert = jnp.minimum(ended, num_experts - 1)
  return GroupLayout(dest, tile_expert, tile_start, tile_count)
