"""Replacements for the primitives whose result depends on a reduction order.

Each rule takes the rewrite options, the equation (for its parameters and
output types) and the input values, and returns the output value(s) with the
equation's output types (dtype and weak type). ``RULES`` maps a primitive
name to its rule; ``ORDER_FREE`` lists the reductions kept as they are and why;
``UNSUPPORTED`` those the transformation refuses (``strict``) or leaves as is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lax import lax as lax_internal

from jaxrl_kernels import _backend
from jaxrl_kernels.gemm import det_matmul
from jaxrl_kernels.reduce import api as reduce_api
from jaxrl_kernels.reduce.segment import segment_rows_add

_GEMM_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Options:
  """What :func:`jaxrl_kernels.batch_invariant` was asked for.

  ``implementation`` goes to every ``det_matmul`` and reduction (None: by
  device). ``strict`` makes an order-dependent primitive without a rewrite an
  error; otherwise a warning.
  """

  implementation: str | None = None
  strict: bool = True


class Unsupported(Exception):
  """An equation the rules cannot rewrite; the interpreter decides whether to raise."""


def _as_out_type(x: jax.Array, aval) -> jax.Array:
  """``x`` with the equation's output dtype and weak type (loop carries check both)."""
  if x.dtype != aval.dtype or getattr(x.aval, "weak_type", False) != aval.weak_type:
    return lax_internal._convert_element_type(x, aval.dtype, aval.weak_type)
  return x


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def _gemm_impl(opts: Options, batched: bool) -> str | None:
  """The implementation of one product (``"products"``: :func:`_products_cpu`).

  A product with batch dimensions (attention's ``QK^T`` and ``PV``) has no
  weight: its N and K are key counts that differ between prefill and decode,
  so its order per element must not depend on N or K. ``det_matmul`` picks
  Mosaic or Triton on a GPU from N and K, and the ``"cpu"`` GEMM's blocking
  follows the operand shapes; such products run the Triton kernel on a GPU
  (order fixed by its K tile alone) and :func:`_products_cpu` on the CPU.
  """
  if opts.implementation is None and batched:
    return "triton" if _backend.platform() == "gpu" else "products"
  return opts.implementation


def _products_cpu(a: jax.Array, w: jax.Array, *, transpose_b: bool, out_dtype) -> jax.Array:
  """``[B, M, K] x [B, N, K] (or [B, K, N]) -> [B, M, N]`` as float32 products summed
  over K by ``det_sum``: each element's order is the reduce op's lane order over
  its own K terms, whatever M and N, and trailing zero terms add nothing."""
  w_nk = w if transpose_b else jnp.swapaxes(w, 1, 2)
  prod = guard(a.astype(jnp.float32)[:, :, None, :] * w_nk.astype(jnp.float32)[:, None, :, :])
  return reduce_api.det_sum(prod, axis=-1, implementation="cpu").astype(out_dtype)


def dot_general(opts: Options, eqn, lhs, rhs, *, activations: bool = False):
  """``dot_general`` as ``det_matmul``: batch dims vmapped, free dims flattened into
  rows (M) and columns (N), contracting dims into K in their listed order.

  The weight (the ``det_matmul`` right operand, which picks the kernel) is the
  operand with fewer free dimensions, the right one on a tie: ``x @ W`` and
  ``einsum("btd,df->btf")`` take ``W``; ``einsum("df,btd->btf")`` too.
  ``activations`` (a product of two activations, ``interpreter.activation_products``)
  takes the path of products with batch dimensions even where there are none left.
  """
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  out_aval = eqn.outvars[0].aval
  if not (_is_float(lhs) and _is_float(rhs)):
    if jnp.issubdtype(lhs.dtype, jnp.integer) and jnp.issubdtype(rhs.dtype, jnp.integer):
      return None  # exact: any order gives the same integer
    raise Unsupported(f"dot_general of {lhs.dtype} and {rhs.dtype}")
  dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
  if dtype.name not in _GEMM_DTYPES:
    raise Unsupported(f"dot_general in {dtype.name} (det_matmul takes {_GEMM_DTYPES})")
  lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
  lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
  rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
  batch_shape = [lhs.shape[d] for d in lb]
  lf_shape = [lhs.shape[d] for d in lf]
  rf_shape = [rhs.shape[d] for d in rf]
  b = math.prod(batch_shape)
  k = math.prod(lhs.shape[d] for d in lc)
  out_dtype = out_aval.dtype if out_aval.dtype.name in _GEMM_DTYPES else dtype
  swap = len(lf) < len(rf)
  rows, rows_c, rows_b, rows_f = (rhs, rc, rb, rf) if swap else (lhs, lc, lb, lf)
  wt, wt_c, wt_b, wt_f = (lhs, lc, lb, lf) if swap else (rhs, rc, rb, rf)
  m = math.prod(rows.shape[d] for d in rows_f)
  n = math.prod(wt.shape[d] for d in wt_f)
  a = jnp.transpose(rows, list(rows_b) + rows_f + list(rows_c)).reshape(b, m, k)
  # A weight stored [N, K] (contracting dims last, in order) is read in place.
  transpose_b = list(wt_f) + list(wt_c) == sorted(wt_f + list(wt_c)) and bool(wt_f)
  if transpose_b:
    w = jnp.transpose(wt, list(wt_b) + wt_f + list(wt_c)).reshape(b, n, k)
  else:
    w = jnp.transpose(wt, list(wt_b) + list(wt_c) + wt_f).reshape(b, k, n)
  impl = _gemm_impl(opts, batched=bool(lb) or activations)
  if impl == "products":
    out = _products_cpu(a, w, transpose_b=transpose_b, out_dtype=out_dtype)
    if swap:
      out = jnp.swapaxes(out, 1, 2)
    return _as_out_type(out.reshape(batch_shape + lf_shape + rf_shape), out_aval)

  def one(a2, w2):
    return det_matmul(a2, w2, transpose_b=transpose_b, out_dtype=out_dtype,
                      implementation=impl)

  out = one(a[0], w[0])[None] if b == 1 else jax.vmap(one)(a, w)  # [B, M, N]
  if swap:
    out = jnp.swapaxes(out, 1, 2)
  out = out.reshape(batch_shape + lf_shape + rf_shape)
  return _as_out_type(out, out_aval)


def _reduce_impl(opts: Options) -> str | None:
  return opts.implementation


def reduce_sum(opts: Options, eqn, x):
  if not _is_float(x):
    return None  # integer and boolean sums are exact
  out = reduce_api.det_sum(x, axis=tuple(int(a) for a in eqn.params["axes"]),
                           implementation=_reduce_impl(opts))
  return _as_out_type(out, eqn.outvars[0].aval)


def reduce_prod(opts: Options, eqn, x):
  if not _is_float(x):
    return None
  out = reduce_api.det_prod(x, axis=tuple(int(a) for a in eqn.params["axes"]),
                            implementation=_reduce_impl(opts))
  return _as_out_type(out, eqn.outvars[0].aval)


def _cumulative(fn: Callable) -> Callable:
  def rule(opts: Options, eqn, x):
    if not _is_float(x):
      return None
    out = fn(x, axis=int(eqn.params["axis"]), reverse=bool(eqn.params["reverse"]),
             implementation=_reduce_impl(opts))
    return _as_out_type(out, eqn.outvars[0].aval)
  return rule


def _explicit_batching(indices, dn):
  """Scatter dimension numbers without batching dims: each batching dim becomes an
  explicit index component (an iota along the indices' batch dim) into the operand."""
  if not dn.operand_batching_dims:
    return indices, dn
  extra = [lax.broadcasted_iota(indices.dtype, indices.shape[:-1] + (1,), d)
           for d in dn.scatter_indices_batching_dims]
  indices = jnp.concatenate([indices, *extra], axis=-1)
  dn = lax.ScatterDimensionNumbers(
      update_window_dims=dn.update_window_dims,
      inserted_window_dims=tuple(sorted(dn.inserted_window_dims + dn.operand_batching_dims)),
      scatter_dims_to_operand_dims=dn.scatter_dims_to_operand_dims + dn.operand_batching_dims)
  return indices, dn


def scatter_add(opts: Options, eqn, operand, indices, updates):
  """Scatter-add whose indices may repeat, in a run-to-run fixed order.

  Kept as is where no operand element can receive two updates (``unique_indices``,
  or one window per batching-dim element, as in the gradient of
  ``take_along_axis``). Rows of a table indexed by one id per update (an
  embedding gradient) take a sort and a fixed-tree segmented sum; any other
  form adds one index's window at a time, in index order.
  """
  del opts
  params = eqn.params
  if params["unique_indices"] or not _is_float(operand):
    return None
  dn = params["dimension_numbers"]
  batch_dims = range(indices.ndim - 1)
  per_batch = math.prod(indices.shape[d] for d in batch_dims
                        if d not in dn.scatter_indices_batching_dims)
  if per_batch <= 1:
    return None  # every operand element receives at most one window
  indices, dn = _explicit_batching(indices, dn)
  window = tuple(dn.update_window_dims)
  scatter_dims = [d for d in range(updates.ndim) if d not in window]
  n = math.prod(updates.shape[d] for d in scatter_dims)
  idx = indices.reshape(n, indices.shape[-1])
  upd = jnp.transpose(updates, scatter_dims + list(window))
  upd = upd.reshape((n,) + tuple(updates.shape[d] for d in window))
  out_aval = eqn.outvars[0].aval
  mode = params["mode"]
  rows = (dn.inserted_window_dims == (0,) and dn.scatter_dims_to_operand_dims == (0,)
          and upd.shape[1:] == operand.shape[1:])
  if rows:
    ids = idx[:, 0]
    if mode == lax.GatherScatterMode.CLIP:  # XLA clamps a window into the operand
      ids = jnp.clip(ids, 0, operand.shape[0] - 1)
    # FILL_OR_DROP drops an out-of-range id, and so does XLA's scatter under
    # PROMISE_IN_BOUNDS (jnp indexing's gradient): segment_rows_add drops them too.
    out = segment_rows_add(operand, ids, upd)
    return _as_out_type(out, out_aval)
  one_dn = lax.ScatterDimensionNumbers(
      update_window_dims=tuple(range(1, 1 + len(window))),
      inserted_window_dims=dn.inserted_window_dims,
      scatter_dims_to_operand_dims=dn.scatter_dims_to_operand_dims)

  def body(i, acc):
    return lax.scatter_add(acc, lax.dynamic_slice_in_dim(idx, i, 1, 0),
                           lax.dynamic_slice_in_dim(upd, i, 1, 0), one_dn,
                           indices_are_sorted=True, unique_indices=True, mode=mode)

  out = lax.fori_loop(0, n, body, operand)
  return _as_out_type(out, out_aval)


def _uint_of(dtype):
  return {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dtype).itemsize]


def _opaque_zero(x: jax.Array, udtype) -> jax.Array:
  """A ``udtype`` scalar that is always 0, computed from ``x``'s first element
  (``n (n + 1)`` is even; ``_cpu.opaque_zero`` explains why no compiler sees it)."""
  n = lax.bitcast_convert_type(jnp.reshape(x, (-1,))[0], _uint_of(x.dtype)).astype(udtype)
  return (n * (n + udtype(1))) & udtype(1)


@jax.custom_jvp
def guard(x: jax.Array) -> jax.Array:
  """``x`` (any float dtype) unchanged, after an integer XOR of its bits with an opaque
  zero: its consumer sees an integer-to-float bitcast, not the op that made it, so XLA's
  CPU compiler can neither contract a product with the add that consumes it (FMA) nor
  fold the op that made an input into an element-wise function's own code, whatever it
  fuses (``jaxrl_kernels._cpu.guard``, for any float width)."""
  if x.size == 0:
    return x
  u = _uint_of(x.dtype)
  bits = lax.bitcast_convert_type(x, u) ^ _opaque_zero(x, u)
  return lax.bitcast_convert_type(bits, x.dtype)


@guard.defjvp
def _guard_jvp(primals, tangents):
  return guard(primals[0]), tangents[0]


#: Element-wise functions computed by XLA's own code (a polynomial, a Newton step):
#: on the CPU its instructions may merge with the op that made the input (``exp(x - m)``
#: then differs by an ulp between batch sizes) or with the op that consumes the result.
TRANSCENDENTAL = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin",
    "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc",
    "erf_inv", "lgamma", "digamma", "pow", "rsqrt", "sqrt", "cbrt", "div", "igamma",
    "igammac", "bessel_i0e", "bessel_i1e"})
#: Products, which LLVM may contract with the add that consumes them (one FMA).
PRODUCTS = frozenset({"mul", "integer_pow", "square"})
#: The primitives :func:`elementwise` guards.
ELEMENTWISE = TRANSCENDENTAL | PRODUCTS


def elementwise(opts: Options, eqn, *invals):
  """A product or an element-wise function with its result (and a function's float
  inputs) passed through :func:`guard`, on the CPU only: each is then rounded on its
  own, by the same code, in every program and every fusion, so an element's bits do
  not depend on the shape of the array around it. Elsewhere (a GPU contracts only
  inside one kernel, which does not change with the batch) and for integers: None."""
  del opts
  out_aval = eqn.outvars[0].aval
  if (_backend.platform() != "cpu" or eqn.primitive.multiple_results
      or not jnp.issubdtype(out_aval.dtype, jnp.floating)):
    return None
  if eqn.primitive.name in TRANSCENDENTAL:
    invals = [guard(x) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
              and jnp.ndim(x) else x for x in invals]
  out = eqn.primitive.bind(*invals, **eqn.params)
  return _as_out_type(guard(out), out_aval)


RULES: dict[str, Callable] = {
    "dot_general": dot_general,
    "reduce_sum": reduce_sum,
    "reduce_prod": reduce_prod,
    "cumsum": _cumulative(reduce_api.det_cumsum),
    "cumprod": _cumulative(reduce_api.det_cumprod),
    "cumlogsumexp": _cumulative(reduce_api.det_cumlogsumexp),
    "scatter-add": scatter_add,
    "scatter_add": scatter_add,
    **{name: elementwise for name in sorted(ELEMENTWISE)},
}

#: Reductions whose result does not depend on the order, kept as they are.
ORDER_FREE = {
    "reduce_max": "max is exact in any order",
    "reduce_min": "min is exact in any order",
    "argmax": "a total order on (value, index): the first index wins ties in any order",
    "argmin": "a total order on (value, index): the first index wins ties in any order",
    "cummax": "max is exact in any order",
    "cummin": "min is exact in any order",
    "reduce_and": "boolean", "reduce_or": "boolean", "reduce_xor": "boolean",
}

#: Order-dependent primitives without a rewrite.
UNSUPPORTED = {
    "reduce": "a reduction with a user computation",
    "reduce_window_sum": "windowed sums (average pooling)",
    "reduce_window": "windowed reductions with a user computation",
    "conv_general_dilated": "convolutions",
    "select_and_scatter_add": "the max-pooling gradient",
    "scatter-mul": "scatter-multiply with repeated indices",
    "scatter_mul": "scatter-multiply with repeated indices",
    "ragged_dot_general": "ragged (grouped) products",
    "ragged_dot": "ragged (grouped) products",
    "dot_product_attention_fwd_wrapper": "cuDNN attention outside its custom_vjp",
    "dot_product_attention_fwd": "cuDNN attention outside its custom_vjp",
}
