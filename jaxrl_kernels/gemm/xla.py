"""``implementation="xla"``: ``jnp.dot`` with a float32 accumulator.

The baseline the contract tests and benchmarks compare against: XLA picks the
reduction order by shape, so it is **not** batch-invariant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels.gemm.base import GemmBackend


def matmul(lhs: jax.Array, rhs: jax.Array, *, lhs_transposed: bool, rhs_transposed: bool,
           out_dtype) -> jax.Array:
  a = lhs.T if lhs_transposed else lhs
  b = rhs.T if rhs_transposed else rhs
  return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(out_dtype)


BACKEND = GemmBackend("xla", matmul, batch_invariant=False)
