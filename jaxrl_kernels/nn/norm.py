"""``rms_norm`` and ``add_rms_norm``: RMSNorm rows whose bits do not depend on the batch.

``rms_norm(x, w) = round(w * x32 * rsqrt(tree_sum(x32^2) / N + eps))`` over the last axis,
in float32 with one rounding to ``x``'s dtype (``tree_sum``: the row zero-padded to a
power of two and folded in halves, an order fixed by ``N`` alone; XLA's ``jnp.mean``
picks its order from the whole shape). ``add_rms_norm`` first adds a row-parallel
layer's float32 chunk partials to the residual stream, ``x' = round(x + round(tree_c(P_c)
+ bias))`` (the bits of ``x + row_parallel_matmul(...)``), and returns ``(x', rms_norm(x'))``
with the very bits of those two calls: one pass over the rows instead of three.

Implementations: ``"triton"`` (``pallas/rmsnorm_triton.py``, one kernel; ``"mosaic"`` and
``"cuda"`` run it too), ``"interpret"`` (that kernel on the CPU interpreter), ``"cpu"``
(the same operations as XLA element-wise ops, guarded against FMA contraction, see
``jaxrl_kernels/_cpu.py``) and ``"xla"`` (the stock ``jnp.mean`` form, not invariant).
Gradients (``jax.custom_vjp``; the ``"xla"`` baseline: plain autodiff) are those of the
float32 formula with the row mean as XLA's reduction; the weight's (and ``add_rms_norm``'s
bias's) sum over rows is :func:`jaxrl_kernels.reduce.det_sum` (XLA's GPU column reduction
adds with atomics): deterministic run to run (their bits are not claimed to be
batch-invariant). The kernel implementations compute the weight's sum in one column-sum
kernel that reads ``g`` and ``x`` (``pallas/reduce_triton.product_reduce_cols``), with the
bits of that ``det_sum``. The backward does not differentiate
``tree_sum``: its slices and adds are element-wise, so XLA would fuse them into every
consumer, and the weight gradient's column reduction would recompute each row's tree once
per column.

:class:`RMSNorm` is the Flax NNX module over them (a ``weight`` parameter), used by every
model of the package.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxrl_kernels import _backend, _validation
from jaxrl_kernels._cpu import guard, opaque_zero, tree_sum
from jaxrl_kernels.gemm.row_parallel import pairwise_tree
from jaxrl_kernels.reduce import det_sum, det_sum_scaled_products

# The one dispatch table: implementation name -> what runs (_backend.RowOpBackend; the
# backward is the float32 formula under JAX's autodiff for every implementation).
BACKENDS: dict[str, _backend.RowOpBackend] = _backend.row_op_backends()


def _formula(x, weight, eps: float, stock: bool):
  """The float32 formula in XLA ops: the ``"cpu"`` forward (``tree_sum``, guarded), and with
  ``stock`` the ``"xla"`` baseline and every backward (``jnp.mean``: XLA's order)."""
  x32 = x.astype(jnp.float32)
  if stock:
    ms = jnp.mean(x32 * x32, axis=-1, keepdims=True)
  else:
    # No square meets the add of the tree, and the mean (``/ n`` may become ``* (1 / n)``)
    # does not meet ``+ eps``, in any fusion: XLA's CPU compiler would otherwise contract
    # them into FMAs in one program (a decode step) and not in another (a forward).
    zero = opaque_zero(x32)
    ms = guard(tree_sum(guard(x32 * x32, zero)) / jnp.float32(x.shape[-1]), zero)[..., None]
  y = x32 * lax.rsqrt(ms + jnp.float32(eps))
  return (weight.astype(jnp.float32) * y).astype(x.dtype)


def _residual(x, partials, bias):
  delta = pairwise_tree(list(partials))
  if bias is not None:
    delta = delta + bias.astype(jnp.float32)
  return x + delta.astype(x.dtype)


@_backend.kernel_jit(static_argnames=("eps", "interpret"))
def _kernel(x2, weight, partials, bias, *, eps: float, interpret: bool):
  from jaxrl_kernels.pallas import rmsnorm_triton
  return rmsnorm_triton.rms_norm_rows(x2, weight, eps=eps, interpret=interpret,
                                      partials=partials, bias=bias)


def _forward(x, weight, partials, bias, eps: float, impl: str):
  """``(x', y)`` (``x' = x`` without partials) of implementation ``impl`` (not ``"xla"``)."""
  be = BACKENDS[impl]
  if not be.kernel or x.size == 0:
    x = x if partials is None else _residual(x, partials, bias)
    return x, _formula(x, weight, eps, stock=False)
  n = x.shape[-1]
  x2 = x.reshape(-1, n)
  p2 = None if partials is None else partials.reshape(partials.shape[0], -1, n)
  out = _kernel(x2, weight, p2, bias, eps=eps, interpret=be.interpret)
  if partials is None:
    return x, out.reshape(x.shape)
  return out[0].reshape(x.shape), out[1].reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, weight, eps, impl):
  return _forward(x, weight, None, None, eps, impl)[1]


def _rms_norm_fwd(x, weight, eps, impl):
  return _rms_norm(x, weight, eps, impl), (x, weight)


def _over_rows(v: jax.Array, impl: str) -> jax.Array:
  """float32 ``sum`` of ``v [..., N]`` over every row, in the fixed order of
  :func:`jaxrl_kernels.reduce.det_sum` (XLA's GPU column reduction adds with atomics: its
  bits change from run to run)."""
  v2 = v.astype(jnp.float32).reshape(-1, v.shape[-1])
  return det_sum(v2, axis=0, implementation=impl)


def _backward(x, weight, g, eps: float, impl: str):
  """``(dx, dw)`` of the float32 formula: dx by XLA's autodiff of the rows (row-local),
  dw as the fixed-order sum over rows of ``g32 * y``, ``y = x32 * rstd``, ``rstd =
  rsqrt(mean(x32^2) + eps)`` (:func:`jaxrl_kernels.reduce.det_sum_scaled_products`, from
  ``g``, ``x`` and the ``rstd`` of dx's formula)."""

  def rows(x):  # the stock formula, with rstd as aux
    x32 = x.astype(jnp.float32)
    rstd = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + jnp.float32(eps))
    return (weight.astype(jnp.float32) * (x32 * rstd)).astype(x.dtype), rstd

  _, vjp, rstd = jax.vjp(rows, x, has_aux=True)
  (dx,) = vjp(g)
  # The formula rounds w * y to x's dtype: its cotangent reaches w * y as g in float32.
  n = x.shape[-1]
  dw = det_sum_scaled_products(g.reshape(-1, n), x.reshape(-1, n), rstd.reshape(-1),
                               implementation=impl)
  return dx, dw.astype(weight.dtype)


def _rms_norm_bwd(eps, impl, res, g):
  x, weight = res
  return _backward(x, weight, g, eps, impl)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _add_rms_norm(x, partials, weight, bias, eps, impl, chunks):
  return _forward(x, weight, partials, bias, eps, impl)


def _add_rms_norm_fwd(x, partials, weight, bias, eps, impl, chunks):
  out = _add_rms_norm(x, partials, weight, bias, eps, impl, chunks)
  # The partials are not kept (C float32 copies of the activation): the tree's derivative
  # is 1 for every leaf, so their cotangent is the residual's, broadcast.
  return out, (out[0], weight, bias)


def _add_rms_norm_bwd(eps, impl, chunks, res, g):
  x_new, weight, bias = res
  g_x, g_y = g
  g_norm, dw = _backward(x_new, weight, g_y, eps, impl)
  # d x' / d delta = 1 (the rounding), d delta / d P_c = 1.
  d_delta = g_x.astype(jnp.float32) + g_norm.astype(jnp.float32)
  dp = jnp.broadcast_to(d_delta, (chunks, *d_delta.shape))
  db = None
  if bias is not None:
    db = _over_rows(d_delta, impl).astype(bias.dtype)
  return d_delta.astype(x_new.dtype), dp, dw, db


_add_rms_norm.defvjp(_add_rms_norm_fwd, _add_rms_norm_bwd)


def _check(op, x, weight, eps, implementation):
  x = jnp.asarray(x)
  weight = jnp.asarray(weight)
  _validation.check_float_array(op, "x", x)
  _validation.check_float_array(op, "weight", weight)
  if x.ndim < 1:
    raise ValueError(f"{op}: x must have at least one axis, got a scalar")
  if weight.shape != x.shape[-1:]:
    raise ValueError(f"{op}: weight must have shape {x.shape[-1:]} (x's last axis), got "
                     f"{weight.shape}")
  eps = _validation.as_scalar(op, "eps", eps, positive=True, allow_traced=False)
  impl = _backend.resolve(op, implementation, x.dtype, supported=tuple(BACKENDS))
  return x, weight, float(eps), BACKENDS[impl].name


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float,
             implementation: str | None = None) -> jax.Array:
  """RMSNorm over the last axis: ``round(w * x32 * rsqrt(mean(x32^2) + eps))``.

  The mean of squares is :func:`tree_sum` ``/ N`` (module docstring), so a row's bits do
  not depend on the other rows (batch, sequence length, padding), except for
  ``implementation="xla"`` (``jnp.mean``, the stock baseline).

  Args:
    x: ``[..., N]`` bfloat16, float16 or float32.
    weight: ``[N]`` float (used in float32).
    eps: static positive float.
    implementation: ``"triton"`` (also for ``"mosaic"``/``"cuda"``), ``"interpret"``,
      ``"cpu"``, ``"xla"`` or None (by device: the kernel on a GPU, ``"cpu"`` on the CPU).

  Returns:
    ``[..., N]`` in ``x.dtype``.

  >>> import jax.numpy as jnp
  >>> y = rms_norm(jnp.full((2, 4), 2.0), jnp.ones((4,)), eps=1e-6, implementation="cpu")
  >>> jnp.round(y, 4).tolist()
  [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
  """
  x, weight, eps, impl = _check("rms_norm", x, weight, eps, implementation)
  if BACKENDS[impl].stock:  # the baseline: plain ops under jax's own autodiff
    return _formula(x, weight, eps, stock=True)
  return _rms_norm(x, weight, eps, impl)


def add_rms_norm(x: jax.Array, partials: jax.Array, weight: jax.Array, *, eps: float,
                 bias: jax.Array | None = None, implementation: str | None = None
                 ) -> tuple[jax.Array, jax.Array]:
  """The residual add of a row-parallel layer and the RMSNorm after it, in one pass.

  ``x' = round(x + round(tree_c(partials[c]) + bias))`` (the float32 adjacent-pair tree of
  :func:`jaxrl_kernels.gemm.row_parallel_matmul`, ``+ bias`` in float32, rounded to
  ``x``'s dtype, then the residual add) and ``y = rms_norm(x', weight)``: bitwise
  ``x + row_parallel_matmul(...)`` and :func:`rms_norm` of it, for every implementation.

  Args:
    x: ``[..., N]`` the residual stream.
    partials: ``[C, ..., N]`` float32 chunk partials (``C`` a power of two), e.g.
      :func:`jaxrl_kernels.gemm.row_parallel_partials`.
    weight: ``[N]`` the norm's weight.
    eps: static positive float.
    bias: optional ``[N]`` of the row-parallel layer.
    implementation: as :func:`rms_norm`.

  Returns:
    ``(x', y)``, both ``[..., N]`` in ``x.dtype``.
  """
  op = "add_rms_norm"
  x, weight, eps, impl = _check(op, x, weight, eps, implementation)
  partials = jnp.asarray(partials)
  if partials.dtype != jnp.float32:
    raise TypeError(f"{op}: partials must be float32, got {partials.dtype}")
  c = partials.shape[0] if partials.ndim else 0
  if partials.shape[1:] != x.shape or c < 1 or c & (c - 1):
    raise ValueError(f"{op}: partials must have shape [C, *{x.shape}] with C a power of "
                     f"two, got {partials.shape}")
  if bias is not None:
    bias = jnp.asarray(bias)
    _validation.check_float_array(op, "bias", bias)
    if bias.shape != x.shape[-1:]:
      raise ValueError(f"{op}: bias must have shape {x.shape[-1:]}, got {bias.shape}")
  if BACKENDS[impl].stock:  # the baseline: plain ops under jax's own autodiff
    x = _residual(x, partials, bias)
    return x, _formula(x, weight, eps, stock=True)
  return _add_rms_norm(x, partials, weight, bias, eps, impl, c)


class RMSNorm(nnx.Module):
  """RMSNorm: ``(weight * x32 * rsqrt(mean(x32^2) + eps)).astype(dtype)``, in float32.

  :func:`jaxrl_kernels.nn.rms_norm` (the mean of squares is :func:`tree_sum` ``/ n``,
  ``jnp.mean`` on the stock path; one kernel on a GPU). ``transformers`` rounds the
  normalised ``x`` to the activation dtype before the weight multiply; here there is one
  rounding, at the end: XLA may drop an intermediate rounding in one fusion and keep it in
  another (``xla_allow_excess_precision``), which would make decode and prefill differ in
  bf16. In float32 the two are the same. ``x [..., n]`` -> the same shape and dtype.
  """

  def __init__(self, dim: int, *, eps: float, param_dtype, implementation: str | None,
               axis_name: str = "embed"):
    self.eps = eps
    self.implementation = implementation
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.weight.set_metadata(logical_axes=(axis_name,))

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.weight[...], eps=self.eps, implementation=self.implementation)

  def add(self, x: jax.Array, partials: jax.Array, bias: jax.Array | None
          ) -> tuple[jax.Array, jax.Array]:
    """``(x', norm(x'))`` with ``x' = x + round(tree(partials) + bias)``: bitwise
    ``x + row_linear(...)`` and this norm of it, in one pass (:func:`nn.add_rms_norm`)."""
    return add_rms_norm(x, partials, self.weight[...], eps=self.eps, bias=bias,
                        implementation=self.implementation)
