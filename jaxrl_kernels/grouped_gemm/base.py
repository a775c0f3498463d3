"""What every ``grouped_matmul`` backend provides (the dispatch table in ``api.py`` holds them).

* ``matmul(lhs [P, K], rhs, tile_expert, *, rhs_transposed, out_dtype)``: row tile
  ``i`` of the ``[P, N]`` result is ``lhs[tile i] @ op(rhs[tile_expert[i]])``
  (``rhs`` ``[E, K, N]``, or ``[E, N, K]`` read in place when ``rhs_transposed``),
  float32 accumulation over K in the contract's K tiles, ascending.
* ``weight_grad(lhs [P, K], g [P, N], layout, *, num_experts, out_dtype)``: ``[E, K, N]``,
  ``dw[e] = lhs[rows of e]^T @ g[rows of e]``, the expert's row tiles in ascending order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class GroupedGemmBackend:
  """One implementation of ``grouped_matmul``.

  Attributes:
    name: the implementation that runs (``"mosaic"`` and ``"cuda"`` run ``"triton"``).
    matmul: the forward (and ``dlhs``) product, see the module docstring.
    weight_grad: the ``dw`` product.
    batch_invariant: whether a row's bits are independent of the other rows (False
      only for the ``"xla"`` baseline, ``jax.lax.ragged_dot``).
  """

  name: str
  matmul: Callable[..., jax.Array]
  weight_grad: Callable[..., jax.Array]
  batch_invariant: bool = True
