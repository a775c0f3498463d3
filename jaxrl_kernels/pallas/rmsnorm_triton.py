"""RMSNorm rows in one Pallas kernel (Triton lowering; interpret mode on CPU).

``y[r] = round(w * x[r] * rsqrt(sum(x[r]^2) / N + eps))`` in float32 with one rounding to
``x``'s dtype, for each row of ``x [R, N]``. With ``partials``, the residual add of a
row-parallel layer comes first, in the same kernel:

    x'[r] = round(x[r] + round(tree_c(partials[c, r]) + bias)),   y[r] = norm(x'[r]),

the tree being :func:`jaxrl_kernels.gemm.row_parallel.pairwise_tree` over the leading
chunk axis (adjacent pairs) and each add a float32 add: ``x'`` is bitwise what the XLA
ops ``x + row_parallel_matmul(...)`` give (element-wise IEEE adds, the same operands).

The order of the sum of squares: the row, zero-padded to the power of two ``W >= N``, is
folded in halves (``x[:W/2] + x[W/2:]``, then again, down to one value): the order of
``_cpu.tree_sum``, fixed by ``N`` alone. A program holds ``block_rows`` whole
rows, ``block_rows`` is a function of ``N`` only, so every call of a given ``N`` and dtype
compiles to one program (only the grid and the row-count mask differ) and a row's bits do
not depend on the number of rows, its position or its neighbours. Both variants run the
same normalisation code on ``x'``: the fused one gives the plain one's ``y`` for the same
``x'`` (tested on the GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_kernels.pallas import _common

# Elements per program: whole rows, as many as fit (a function of N only).
_ELEMENTS = 2048


def width_for(n: int) -> int:
  """The power of two ``W >= n`` that a row is padded to (zeros) for the halving tree."""
  return 1 << max(0, (n - 1).bit_length())


def block_rows_for(n: int) -> int:
  """Rows per program: a function of ``N`` alone (the same program for every row count)."""
  return max(1, _ELEMENTS // width_for(n))


def _tree(x):
  """Sum over the last axis of ``[rows, W]`` by halving (W a power of two): ``[rows, 1]``."""
  while x.shape[-1] > 1:
    lo, hi = jnp.split(x, 2, axis=-1)
    x = lo + hi
  return x


def _normalize(x32, w32, *, n: int, eps: float):
  """The row normalisation, one code for both variants."""
  ms = _tree(x32 * x32) / jnp.float32(n)
  return w32 * (x32 * lax.rsqrt(ms + jnp.float32(eps)))


def _kernel(*refs, rows, n, width, block_rows, eps, chunks, has_bias):
  if chunks:
    x_ref, p_ref, *refs = refs
  else:
    x_ref, *refs = refs
  b_ref = refs.pop(0) if has_bias else None
  w_ref, *outs = refs
  i = pl.program_id(0)
  row0 = i * block_rows
  row_ids = row0 + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
  cols = lax.broadcasted_iota(jnp.int32, (width,), 0)
  col_ok = cols < n
  mask = (row_ids < rows)[:, None] & col_ok[None, :]
  window = (pl.ds(row0, block_rows), pl.ds(0, width))
  x = pltriton.load(x_ref.at[window], mask=mask, other=0)
  w32 = pltriton.load(w_ref.at[pl.ds(0, width)], mask=col_ok, other=0).astype(jnp.float32)
  if chunks:
    parts = [pltriton.load(p_ref.at[(jnp.int32(c), *window)], mask=mask, other=0)
             for c in range(chunks)]
    while len(parts) > 1:  # adjacent pairs, as row_parallel.pairwise_tree
      parts = [parts[j] + parts[j + 1] for j in range(0, len(parts), 2)]
    delta = parts[0]
    if has_bias:
      b32 = pltriton.load(b_ref.at[pl.ds(0, width)], mask=col_ok, other=0).astype(jnp.float32)
      delta = delta + b32[None, :]
    delta = delta.astype(x.dtype)
    x = (x.astype(jnp.float32) + delta.astype(jnp.float32)).astype(x.dtype)
    pltriton.store(outs[0].at[window], x, mask=mask)
  y = _normalize(x.astype(jnp.float32), w32[None, :], n=n, eps=eps)
  pltriton.store(outs[-1].at[window], y.astype(outs[-1].dtype), mask=mask)


def rms_norm_rows(x: jax.Array, weight: jax.Array, *, eps: float, interpret: bool,
                  partials: jax.Array | None = None, bias: jax.Array | None = None):
  """RMSNorm of the rows of ``x [R, N]`` (see the module docstring).

  Args:
    x: ``[R, N]`` bfloat16, float16 or float32.
    weight: ``[N]`` (any float dtype; used in float32).
    eps: the static epsilon.
    interpret: run the Pallas interpreter (CPU) instead of compiling with Triton.
    partials: optional ``[C, R, N]`` float32 chunk partials of a row-parallel product
      (``C`` a power of two), added to ``x`` first (with ``bias [N]``).
    bias: optional ``[N]``, only with ``partials``.

  Returns:
    ``y [R, N]`` in ``x.dtype``; with ``partials``, ``(x', y)``.
  """
  rows, n = x.shape
  width = width_for(n)
  br = block_rows_for(n)
  chunks = 0 if partials is None else partials.shape[0]
  if chunks & (chunks - 1):
    raise ValueError(f"rms_norm_rows: the chunk count must be a power of two, got {chunks}")
  if bias is not None and partials is None:
    raise ValueError("rms_norm_rows: bias needs partials")
  out = jax.ShapeDtypeStruct((rows, n), x.dtype)
  kernel = functools.partial(_kernel, rows=rows, n=n, width=width, block_rows=br, eps=eps,
                             chunks=chunks, has_bias=bias is not None)
  args = [x] + ([] if partials is None else [partials]) + ([] if bias is None else [bias])
  res = pl.pallas_call(
      kernel,
      grid=(_common.cdiv(rows, br),),
      out_shape=(out, out) if chunks else out,
      interpret=interpret,
      name="add_rms_norm_rows" if chunks else "rms_norm_rows",
      **_common.triton_compiler_params(4 if width <= 2048 else 8, 1, interpret),
  )(*args, weight)
  return res
