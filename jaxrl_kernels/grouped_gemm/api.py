"""``grouped_matmul``: the batch-invariant grouped (per-expert) GEMM, forward and backward.

Contract: on the tile-aligned group layout (``layout.py``), row ``r`` of the result
is bitwise a function of row ``r`` of ``lhs`` and its expert's weight only,
whatever the number of rows routed to that expert or to the others, the row's
place in its group, or padding; ``dlhs`` rows likewise; ``dw`` is deterministic
run to run. Every implementation but ``"xla"`` (``jax.lax.ragged_dot``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_kernels import _backend, _validation
from jaxrl_kernels.grouped_gemm import cpu, triton, xla
from jaxrl_kernels.grouped_gemm.base import GroupedGemmBackend
from jaxrl_kernels.grouped_gemm.layout import GroupLayout

_OP = "grouped_matmul"
_FLOAT_DTYPES = ("bfloat16", "float16", "float32")

# The one dispatch table: implementation name -> the backend that runs the forward
# product and both backward products.
BACKENDS: dict[str, GroupedGemmBackend] = {
    "mosaic": triton.TRITON,
    "cuda": triton.TRITON,
    "triton": triton.TRITON,
    "interpret": triton.INTERPRET,
    "cpu": cpu.BACKEND,
    "xla": xla.BACKEND,
}
IMPLEMENTATIONS = tuple(BACKENDS)


def resolve_implementation(implementation: str | None, dtype) -> str:
  """The implementation name ``grouped_matmul`` runs (validated for this device)."""
  impl = _backend.resolve(_OP, implementation, dtype, supported=IMPLEMENTATIONS)
  return BACKENDS[impl].name


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped(lhs, w, layout, transpose_w, out_dtype, implementation):
  return BACKENDS[implementation].matmul(lhs, w, layout.tile_expert, rhs_transposed=transpose_w,
                                         out_dtype=out_dtype)


def _fwd(lhs, w, layout, transpose_w, out_dtype, implementation):
  return _grouped(lhs, w, layout, transpose_w, out_dtype, implementation), (lhs, w, layout)


def _bwd(transpose_w, out_dtype, implementation, res, g):
  lhs, w, layout = res
  be = BACKENDS[implementation]
  g = g.astype(lhs.dtype)
  # dlhs = g @ op(w[e])^T: the same tile walk, so dlhs rows are invariant too.
  dlhs = be.matmul(g, w, layout.tile_expert, rhs_transposed=not transpose_w,
                   out_dtype=lhs.dtype)
  # dw[e] = lhs[rows of e]^T g[rows of e] (or its transpose for an [E, N, K] weight).
  a, b = (g, lhs) if transpose_w else (lhs, g)
  dw = be.weight_grad(a, b, layout, num_experts=w.shape[0], out_dtype=w.dtype)
  return dlhs, dw, None


_grouped.defvjp(_fwd, _bwd)


def grouped_matmul(lhs: jax.Array, w: jax.Array, layout: GroupLayout, *,
                   transpose_w: bool = False, out_dtype=None,
                   implementation: str | None = None) -> jax.Array:
  """Per-expert products on the tile-aligned group layout.

  ``out[p] = lhs[p] @ w[e(p)]`` where ``e(p)`` is the expert of row ``p``'s tile
  (``layout.tile_expert``), float32 accumulation over K in the contract's fixed K
  tiles, ascending (CONTRACT.md, "grouped GEMM").

  Args:
    lhs: ``[P, K]`` with ``P == layout.rows`` (rows placed by ``layout.dest``; other
      rows zero, e.g. ``jnp.zeros((P, K)).at[layout.dest].set(x)``).
    w: ``[E, K, N]``, or ``[E, N, K]`` with ``transpose_w=True`` (read in place: an
      ``[E, out, in]`` checkpoint layout needs no transpose).
    layout: from :func:`~jaxrl_kernels.grouped_gemm.group_layout`.
    transpose_w: whether ``w`` is laid out ``[E, N, K]``.
    out_dtype: result dtype (default: ``lhs``'s).
    implementation: ``"triton"``, ``"interpret"``, ``"cpu"``, ``"xla"``
      (``jax.lax.ragged_dot``, not invariant), ``"mosaic"``/``"cuda"`` (run the Triton
      kernels) or None (by device).

  Returns:
    ``[P, N]`` in ``out_dtype``; rows outside every group are zero. ``P = 0`` (no
    assignments) gives ``[0, N]`` and zero gradients.

  Gradients (``jax.custom_vjp``): ``dlhs`` by the same tile walk (rows invariant),
  ``dw[e]`` summing expert ``e``'s row tiles in ascending order (deterministic).
  """
  for name, x in (("lhs", lhs), ("w", w)):
    _validation.check_float_array(_OP, name, x, _FLOAT_DTYPES)
  if lhs.ndim != 2 or w.ndim != 3:
    raise ValueError(f"{_OP}: lhs must be [P, K] and w [E, K, N] (or [E, N, K]), got "
                     f"lhs {lhs.shape} and w {w.shape}")
  if lhs.dtype != w.dtype:
    raise TypeError(f"{_OP}: lhs and w must have the same dtype, got {lhs.dtype} and "
                    f"{w.dtype}; cast one explicitly")
  k_w = w.shape[2] if transpose_w else w.shape[1]
  if lhs.shape[1] != k_w:
    raise ValueError(f"{_OP}: lhs has K={lhs.shape[1]} but w {w.shape} has K={k_w}"
                     f"{' (transpose_w=True: [E, N, K])' if transpose_w else ''}")
  if lhs.shape[0] != layout.rows:
    raise ValueError(f"{_OP}: lhs has {lhs.shape[0]} rows but the layout has {layout.rows}")
  if layout.tile_start.shape[0] != w.shape[0]:
    raise ValueError(f"{_OP}: the layout has {layout.tile_start.shape[0]} experts but w has "
                     f"{w.shape[0]}")
  out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else
                        _validation.as_float_dtype(_OP, "out_dtype", out_dtype, _FLOAT_DTYPES))
  impl = resolve_implementation(implementation, lhs.dtype)
  if lhs.shape[0] == 0:  # no assignments (an empty batch): the kernels need a row tile
    return jnp.zeros((0, w.shape[1] if transpose_w else w.shape[2]), out_dtype)
  return _grouped(lhs, w, layout, bool(transpose_w), out_dtype, impl)
