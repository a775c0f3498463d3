"""``implementation="xla"``: ``jax.lax.ragged_dot``, the stock grouped GEMM.

The baseline benchmarks and the stock-path controls compare against: XLA picks
the product's blocking by the whole shape, so a row's bits are not guaranteed to
be independent of the other rows. Nor are its non-finite values: on the CPU, a NaN or
inf in any expert's weight makes every row NaN (docs/moe.md), where the other
implementations confine it to that expert's rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels.contract import GROUPED_GEMM_BLOCK_M
from jaxrl_kernels.grouped_gemm.base import GroupedGemmBackend


def _group_sizes(tile_expert: jax.Array, num_experts: int) -> jax.Array:
  # Rows of each expert's tiles; tiles after the used ones count for the last expert
  # (their rows are zero).
  tiles = jnp.zeros((num_experts,), jnp.int32).at[tile_expert].add(1)
  return tiles * GROUPED_GEMM_BLOCK_M


def matmul(lhs, rhs, tile_expert, *, rhs_transposed: bool, out_dtype) -> jax.Array:
  w = jnp.swapaxes(rhs, 1, 2) if rhs_transposed else rhs
  sizes = _group_sizes(tile_expert, w.shape[0])
  return lax.ragged_dot(lhs, w, sizes, preferred_element_type=jnp.float32).astype(out_dtype)


def weight_grad(lhs, g, layout, *, num_experts: int, out_dtype) -> jax.Array:
  sizes = _group_sizes(layout.tile_expert, num_experts)
  w0 = jnp.zeros((num_experts, lhs.shape[1], g.shape[1]), jnp.float32)
  _, vjp = jax.vjp(lambda w: lax.ragged_dot(lhs.astype(jnp.float32), w, sizes), w0)
  return vjp(g.astype(jnp.float32))[0].astype(out_dtype)


BACKEND = GroupedGemmBackend("xla", matmul, weight_grad, batch_invariant=False)
