"""Fixed-order reductions: ``det_sum``, ``det_prod`` and the cumulative ``det_cumsum``,
``det_cumprod``, ``det_cumlogsumexp``.

XLA chooses a reduction's order from the shape of the whole array (vectorised
partial sums, a GPU tree sized by the row count), so a row's sum can change
with the batch it sits in, and a sum over keys changes when masked keys are
appended. These ops fix the order (docs/transform.md):

* ``det_sum``/``det_prod`` over an axis of length N: ``REDUCE_LANES`` lanes, lane
  ``j`` accumulating ``x[j], x[j + L], x[j + 2L], ...`` in ascending order, then
  the lanes folded in halves. The order depends on N's tile count only, and
  trailing exact zeros (ones for a product) add an identity to a lane, so a
  sum over ``T`` keys and one over ``max_len`` keys whose tail is 0 are the same
  bits.
* cumulative ops: tiles of ``L`` from index 0, one element after the other
  inside a tile, tile totals carried in ascending order; element ``i``
  depends only on elements ``<= i``.

A sum over leading axes (``det_sum(x, axis=0)`` of ``[R, N]``, a weight gradient over
tokens) runs the column form of the kernel, which reads ``x`` as it lies: the same bits
as the transposed rows.

Implementations: ``"triton"`` (the Pallas kernel, GPU), ``"interpret"`` (the
same kernel on the CPU interpreter), ``"cpu"`` (plain XLA ops in the same
order: bitwise equal to ``"interpret"``) and ``"xla"`` (stock ``jnp.sum``, a
baseline that is not invariant). ``"mosaic"`` and ``"cuda"`` run the Triton
kernel (there is no Hopper-specific reduction), so one implementation name can
be passed to every op of a program. Cumulative ops are plain XLA on every
device except ``"xla"``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels import _backend

# Part of the numerical contract: the lane count fixes every element's place in a sum.
from jaxrl_kernels.contract import REDUCE_LANES as REDUCE_LANES
from jaxrl_kernels.reduce import fixed_order

_FLOAT_DTYPES = ("bfloat16", "float16", "float32")


# The one dispatch table: implementation name -> what runs (_backend.RowOpBackend).
BACKENDS: dict[str, _backend.RowOpBackend] = _backend.row_op_backends()
_SUPPORTED = tuple(BACKENDS)

Axis = int | Sequence[int] | None


def resolve_implementation(op: str, implementation: str | None, dtype) -> str:
  """The implementation ``op`` runs: ``"triton"``, ``"interpret"``, ``"cpu"`` or ``"xla"``."""
  impl = _backend.resolve(op, implementation, dtype, supported=_SUPPORTED)
  return BACKENDS[impl].name


def _check_float(op: str, x: jax.Array) -> None:
  name = jnp.dtype(x.dtype).name
  if name not in _FLOAT_DTYPES and not (name == "float64" and jax.config.jax_enable_x64):
    raise TypeError(f"{op}: x must be one of {_FLOAT_DTYPES}, got {x.dtype}")


def _axes(op: str, axis: Axis, ndim: int) -> tuple[int, ...]:
  if axis is None:
    return tuple(range(ndim))
  axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
  out = []
  for a in axes:
    if not isinstance(a, (int, np.integer)) or isinstance(a, (bool, np.bool_)):
      raise TypeError(f"{op}: axis must be an int, a sequence of ints or None, got {axis!r}")
    a = int(a)
    if not -ndim <= a < ndim:
      raise ValueError(f"{op}: axis {a} is out of range for an array of rank {ndim}")
    out.append(a % ndim)
  if len(set(out)) != len(out):
    raise ValueError(f"{op}: axis {axis!r} repeats an axis")
  return tuple(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _reduce2d(x2, op: str, impl: str):
  backend = BACKENDS[impl]
  if backend.stock:
    stock = jnp.sum if op == "sum" else jnp.prod
    return stock(x2, axis=1)
  if x2.shape[1] == 0 or x2.shape[0] == 0:
    return jnp.full((x2.shape[0],), 0.0 if op == "sum" else 1.0, x2.dtype)
  if not backend.kernel or x2.dtype == jnp.float64 or x2.shape[1] <= REDUCE_LANES:
    # Rows of at most one lane step (a sum over a size-1 or short axis) are one fused
    # elementwise pass in XLA, the kernel's bits (fixed_order.reduce_rows).
    return fixed_order.reduce_rows(x2, op=op, lanes=REDUCE_LANES, out_dtype=x2.dtype)
  return _kernel_rows(x2, op=op, interpret=backend.interpret)


# One jitted function per kernel shape, however many calls (_backend.kernel_jit).
@_backend.kernel_jit(static_argnames=("op", "interpret"))
def _kernel_rows(x2, *, op: str, interpret: bool):
  from jaxrl_kernels.pallas import reduce_triton
  return reduce_triton.reduce_rows(x2, op=op, lanes=REDUCE_LANES, out_dtype=x2.dtype,
                                   interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _reduce2d_cols(x2, op: str, impl: str):
  """``[R, N] -> [N]``: bitwise ``_reduce2d(x2.T, op, impl)`` for a kernel backend, by the
  column kernel (no transpose)."""
  return _kernel_cols(x2, op=op, interpret=BACKENDS[impl].interpret)


@_backend.kernel_jit(static_argnames=("op", "interpret"))
def _kernel_cols(x2, *, op: str, interpret: bool):
  from jaxrl_kernels.pallas import reduce_triton
  return reduce_triton.reduce_cols(x2, op=op, lanes=REDUCE_LANES, out_dtype=x2.dtype,
                                   interpret=interpret)


def _reduce2d_cols_fwd(x2, op, impl):
  out = _reduce2d_cols(x2, op, impl)
  return out, (x2, out)


def _reduce2d_cols_bwd(op, impl, res, g):
  x2, out = res
  if op == "sum":
    return (jnp.broadcast_to(g[None, :], x2.shape).astype(x2.dtype),)
  (dxt,) = _reduce2d_bwd(op, impl, (x2.T, out), g)
  return (dxt.T,)


_reduce2d_cols.defvjp(_reduce2d_cols_fwd, _reduce2d_cols_bwd)


def _by_columns(axes: tuple[int, ...], kept: list[int], reduced: int, impl: str, dtype) -> bool:
  """Whether the column kernel runs: a kernel backend, the reduced axes leading (their
  flat index is then the row of ``x.reshape(reduced, -1)``, no transpose), and more than
  one lane step of them (shorter sums stay one fused element-wise pass in XLA)."""
  return (BACKENDS[impl].kernel and dtype != jnp.float64 and bool(kept)
          and axes == tuple(range(len(axes))) and reduced > REDUCE_LANES)


def _reduce2d_fwd(x2, op, impl):
  out = _reduce2d(x2, op, impl)
  return out, (x2, out)


def _reduce2d_bwd(op, impl, res, g):
  x2, out = res
  if op == "sum":  # d(sum)/dx = 1: a broadcast, no reduction
    return (jnp.broadcast_to(g[:, None], x2.shape).astype(x2.dtype),)
  # d(prod)/dx_i = prod_{j != i} x_j, as products of the other terms in the same fixed order
  n = x2.shape[1]
  others = jnp.where(jnp.eye(n, dtype=bool)[None], jnp.ones((), x2.dtype), x2[:, None, :])
  rest = _reduce2d(others.reshape(-1, n), op, impl).reshape(x2.shape)
  return ((g[:, None] * rest).astype(x2.dtype),)


_reduce2d.defvjp(_reduce2d_fwd, _reduce2d_bwd)


def _reduce(op_name: str, op: str, x, axis: Axis, keepdims: bool,
            implementation: str | None) -> jax.Array:
  x = jnp.asarray(x)
  _check_float(op_name, x)
  axes = _axes(op_name, axis, x.ndim)
  impl = resolve_implementation(op_name, implementation, x.dtype)
  kept = [d for d in range(x.ndim) if d not in axes]
  lead = [x.shape[d] for d in kept]
  reduced = math.prod(x.shape[d] for d in axes)
  if _by_columns(axes, kept, reduced, impl, x.dtype) and x.size:
    # Leading reduced axes: the rows of x.reshape(reduced, -1), summed per column.
    out = _reduce2d_cols(x.reshape(reduced, math.prod(lead)), op, impl).reshape(lead)
  else:
    # Reduced axes go last, flattened row-major: the flat index orders the terms.
    xt = jnp.transpose(x, kept + list(axes))
    out = _reduce2d(xt.reshape(math.prod(lead), reduced), op, impl).reshape(lead)
  if keepdims:
    out = jnp.expand_dims(out, axes)
  return out


def det_sum(x: jax.Array, axis: Axis = None, *, keepdims: bool = False,
            implementation: str | None = None) -> jax.Array:
  r"""Batch-invariant sum with a fixed reduction order.

  .. math::  out = \bigoplus_{j < L} \Big( \sum_{t} x_{j + tL} \Big)

  with the inner sums ascending in ``t`` (``L = REDUCE_LANES``) and the outer
  ``\bigoplus`` a halving tree over the lanes. Several axes are flattened
  row-major into one. The state is float32 (the input dtype for float32 and
  float64); the result has the input dtype.

  Args:
    x: ``[...]`` bfloat16, float16 or float32.
    axis: axis or axes to sum over (None: all).
    keepdims: keep the reduced axes with size 1.
    implementation: ``"triton"``, ``"interpret"``, ``"cpu"``, ``"xla"``, or
      ``"mosaic"``/``"cuda"`` (both run ``"triton"``), or None (by device).

  Row ``r`` of ``det_sum(x, axis=-1)`` is bitwise the same whatever the other
  rows, and appending exact zeros along the summed axis never changes it.

  >>> import jax.numpy as jnp
  >>> det_sum(jnp.arange(6.0).reshape(2, 3), axis=1, implementation="cpu").tolist()
  [3.0, 12.0]
  """
  return _reduce("det_sum", "sum", x, axis, keepdims, implementation)


def det_sum_scaled_products(g: jax.Array, x: jax.Array, scale: jax.Array, *,
                            implementation: str | None = None) -> jax.Array:
  """``det_sum(g32 * (x32 * scale[:, None]), axis=0)``: an RMSNorm weight gradient, the
  sum over rows of the output cotangent times the normalized rows.

  Args:
    g, x: ``[R, N]`` bfloat16, float16 or float32.
    scale: ``[R]`` float32 (the rows' ``rsqrt(mean(x^2) + eps)``).
    implementation: as :func:`det_sum`.

  Returns ``[N]`` float32 with the bits of :func:`det_sum` over the products XLA would write
  (two rounded multiplies each); the kernel implementations form them in registers, reading
  ``g`` and ``x`` where they lie.
  """
  _check_float("det_sum_scaled_products", x)
  if g.shape != x.shape or x.ndim != 2 or scale.shape != x.shape[:1]:
    raise ValueError(f"det_sum_scaled_products: expected g and x [R, N] and scale [R], got "
                     f"g {g.shape}, x {x.shape}, scale {scale.shape}")
  impl = resolve_implementation("det_sum_scaled_products", implementation, x.dtype)
  be = BACKENDS[impl]
  if be.kernel and x.size:
    return _kernel_products(g, x, scale, interpret=be.interpret)
  products = g.astype(jnp.float32) * (x.astype(jnp.float32) * scale[:, None])
  return det_sum(products, axis=0, implementation=impl)


@_backend.kernel_jit(static_argnames=("interpret",))
def _kernel_products(g, x, scale, *, interpret: bool):
  from jaxrl_kernels.pallas import reduce_triton
  return reduce_triton.product_reduce_cols(g, x, scale, lanes=REDUCE_LANES,
                                           interpret=interpret)


def det_prod(x: jax.Array, axis: Axis = None, *, keepdims: bool = False,
             implementation: str | None = None) -> jax.Array:
  """Product in the same fixed order as :func:`det_sum` (trailing ones change nothing)."""
  return _reduce("det_prod", "prod", x, axis, keepdims, implementation)


def _cumulative(op_name: str, op: str, x, axis: int, reverse: bool,
                implementation: str | None) -> jax.Array:
  x = jnp.asarray(x)
  _check_float(op_name, x)
  if not isinstance(reverse, bool):
    raise TypeError(f"{op_name}: reverse must be a bool, got {reverse!r}")
  (ax,) = _axes(op_name, axis, x.ndim)
  impl = resolve_implementation(op_name, implementation, x.dtype)
  if BACKENDS[impl].stock:
    stock = {"cumsum": jax.lax.cumsum, "cumprod": jax.lax.cumprod,
             "cumlogsumexp": jax.lax.cumlogsumexp}[op]
    return stock(x, axis=ax, reverse=reverse)
  xt = jnp.moveaxis(x, ax, -1)
  if reverse:
    xt = jnp.flip(xt, -1)
  shape = xt.shape
  x2 = xt.reshape(math.prod(shape[:-1]), shape[-1])
  if x2.size == 0:
    out = x2
  else:
    out = fixed_order.cumulative_rows(x2, op=op, lanes=REDUCE_LANES)
  out = out.reshape(shape)
  if reverse:
    out = jnp.flip(out, -1)
  return jnp.moveaxis(out, -1, ax)


def det_cumsum(x: jax.Array, axis: int = -1, *, reverse: bool = False,
               implementation: str | None = None) -> jax.Array:
  r"""Inclusive cumulative sum in a fixed order: ``out[i] = carry_t + prefix_t(i)``.

  ``t = i // L``; ``prefix_t(i)`` sums tile ``t`` from its first element to
  ``i`` one after the other, and ``carry_t`` sums the totals of tiles ``< t``
  in ascending order. ``out[i]`` depends only on ``x[:i + 1]`` (for
  ``reverse=True``, on ``x[i:]``, counted from the end). Shapes and dtype as ``x``.

  >>> import jax.numpy as jnp
  >>> det_cumsum(jnp.array([1.0, 2.0, 3.0]), implementation="cpu").tolist()
  [1.0, 3.0, 6.0]
  """
  return _cumulative("det_cumsum", "cumsum", x, axis, reverse, implementation)


def det_cumprod(x: jax.Array, axis: int = -1, *, reverse: bool = False,
                implementation: str | None = None) -> jax.Array:
  """Inclusive cumulative product in the fixed order of :func:`det_cumsum`."""
  return _cumulative("det_cumprod", "cumprod", x, axis, reverse, implementation)


def det_cumlogsumexp(x: jax.Array, axis: int = -1, *, reverse: bool = False,
                     implementation: str | None = None) -> jax.Array:
  """Inclusive ``log(cumsum(exp(x)))`` with ``logaddexp`` in the fixed order of
  :func:`det_cumsum` (top-p sampling in log space)."""
  return _cumulative("det_cumlogsumexp", "cumlogsumexp", x, axis, reverse, implementation)
