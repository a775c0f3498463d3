"""``det_matmul``: the batch-invariant deterministic GEMM (forward and backward).

Contract: row ``r`` of ``a @ b`` is bitwise the same whatever the batch size,
the row's position, padding rows, chunking or ``jax.grad`` around it, for
every implementation but ``"xla"``; ``dA`` rows likewise, ``dB`` run to run.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxrl_kernels import _backend, _validation
from jaxrl_kernels._cpu import sum_to_match
from jaxrl_kernels.gemm import cpu, cuda, mosaic, triton, xla
from jaxrl_kernels.gemm.base import GemmBackend

_OP = "det_matmul"
_FLOAT_DTYPES = ("bfloat16", "float16", "float32")


# The one dispatch table: implementation name -> the backend that runs the
# forward product and both backward products.
BACKENDS: dict[str, GemmBackend] = {
    "mosaic": mosaic.BACKEND,
    "triton": triton.TRITON,
    "interpret": triton.INTERPRET,
    "cuda": cuda.BACKEND,
    "cpu": GemmBackend("cpu", cpu.matmul),
    "xla": xla.BACKEND,
}
IMPLEMENTATIONS = tuple(BACKENDS)


def backend(implementation: str) -> GemmBackend:
  """The backend object of an implementation name (a key of :data:`BACKENDS`)."""
  if implementation not in BACKENDS:
    raise ValueError(f"{_OP}: implementation must be one of {IMPLEMENTATIONS}, got "
                     f"{implementation!r}")
  return BACKENDS[implementation]


# One jitted function per kernel shape, however many layers call it (_backend.kernel_jit).
@_backend.kernel_jit(static_argnames=("lhs_transposed", "rhs_transposed", "out_dtype",
                                      "implementation"))
def matmul2d(lhs: jax.Array, rhs: jax.Array, *, lhs_transposed: bool, rhs_transposed: bool,
             out_dtype, implementation: str) -> jax.Array:
  """One 2-D product ``op(lhs) @ op(rhs)`` on an already resolved implementation.

  Args:
    lhs: ``[M, K]``, or ``[K, M]`` when ``lhs_transposed`` (the dB product).
    rhs: ``[K, N]``, or ``[N, K]`` when ``rhs_transposed`` (read in place).
    out_dtype: dtype of the ``[M, N]`` result (float32 accumulation).
    implementation: a key of :data:`BACKENDS` (see :func:`resolve_implementation`).

  No custom VJP: for use inside other ops' kernels (the LM-head backward).
  """
  m = lhs.shape[1] if lhs_transposed else lhs.shape[0]
  n = rhs.shape[0] if rhs_transposed else rhs.shape[1]
  k = lhs.shape[0] if lhs_transposed else lhs.shape[1]
  if m == 0 or n == 0 or k == 0:
    return jnp.zeros((m, n), out_dtype)
  return backend(implementation).matmul(lhs, rhs, lhs_transposed=lhs_transposed,
                                        rhs_transposed=rhs_transposed, out_dtype=out_dtype)


def _validate(a, b, transpose_b: bool, out_dtype) -> tuple[bool, jnp.dtype]:
  """``(transpose_b, out_dtype)`` checked and normalised (a Python bool, a dtype)."""
  transpose_b = _validation.check_bool(_OP, "transpose_b", transpose_b)
  if a.ndim < 1:
    raise ValueError(f"{_OP}: a must have at least 1 dimension [..., K], got shape {a.shape}")
  if b.ndim != 2:
    raise ValueError(f"{_OP}: b must be 2-D ([K, N], or [N, K] with transpose_b=True), "
                     f"got shape {b.shape}")
  for name, x in (("a", a), ("b", b)):
    _validation.check_float_array(_OP, name, x, _FLOAT_DTYPES)
  if a.dtype != b.dtype:
    raise TypeError(f"{_OP}: a and b must have the same dtype, got a {a.dtype} and b "
                    f"{b.dtype}; cast one explicitly")
  k_b = b.shape[1] if transpose_b else b.shape[0]
  if a.shape[-1] != k_b:
    layout = "[N, K]" if transpose_b else "[K, N]"
    raise ValueError(f"{_OP}: a has K={a.shape[-1]} (shape {a.shape}) but b {layout} has "
                     f"K={k_b} (shape {b.shape})")
  if out_dtype is None:
    return transpose_b, jnp.dtype(a.dtype)
  return transpose_b, _validation.as_float_dtype(_OP, "out_dtype", out_dtype, _FLOAT_DTYPES)


def resolve_implementation(implementation: str | None, dtype, n: int, k: int) -> str:
  """The implementation ``det_matmul`` runs for a ``[K, N]`` weight of ``dtype``.

  ``None`` picks by device (``_backend.default_implementation``) and falls back
  from Mosaic to Triton for a weight Mosaic does not take: by N, K and dtype
  only, so the same for every batch size. Naming an implementation that does
  not take the weight raises a ValueError.
  """
  impl = _backend.resolve(_OP, implementation, dtype, supported=IMPLEMENTATIONS)
  why = backend(impl).supported(n, k, dtype)
  if why is None:
    return impl
  if implementation is None and backend(impl).fallback is not None:
    return backend(impl).fallback
  raise ValueError(f"{_OP}: implementation={impl!r} cannot run a weight with K={k}, N={n} "
                   f"({why}); use implementation='triton'")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _det_matmul2d(a, b, transpose_b, out_dtype, implementation):
  return matmul2d(a, b, lhs_transposed=False, rhs_transposed=transpose_b, out_dtype=out_dtype,
                  implementation=implementation)


def _fwd(a, b, transpose_b, out_dtype, implementation):
  # The same kernel call as the primal: forward-only and training-mode bits agree.
  return _det_matmul2d(a, b, transpose_b, out_dtype, implementation), (a, b)


def _bwd(transpose_b, out_dtype, implementation, res, g):
  a, b = res
  g = g.astype(a.dtype)
  # dA = dC @ B^T: a [M, N] x [N, K] product whose reduction runs over N; each
  # dA row depends only on its dC row, so dA rows are batch-invariant.
  # B is [K, N] (read as [N_out, K_red] = "transposed") or [N, K].
  da = matmul2d(g, b, lhs_transposed=False, rhs_transposed=not transpose_b, out_dtype=a.dtype,
                implementation=implementation)
  # dB = A^T @ dC (or dC^T @ A for a [N, K] weight): a reduction over tokens,
  # deterministic run to run; it depends on the batch by its nature.
  lhs, rhs = (g, a) if transpose_b else (a, g)
  db = matmul2d(lhs, rhs, lhs_transposed=True, rhs_transposed=False, out_dtype=b.dtype,
                implementation=implementation)
  # Inside a user's shard_map (check_vma=True): a replicated weight's gradient from
  # sharded tokens is summed over the axes it does not vary over, as JAX's autodiff does.
  return sum_to_match(da, a), sum_to_match(db, b)


_det_matmul2d.defvjp(_fwd, _bwd)


def det_matmul(a: jax.Array, b: jax.Array, *, transpose_b: bool = False, out_dtype=None,
               implementation: str | None = None) -> jax.Array:
  """Batch-invariant deterministic matrix product ``a @ b``.

  ``out[..., n] = sum_k a[..., k] * b[k, n]`` accumulated in float32 over a
  fixed K tile in ascending K order (no split-K), so row ``r`` of the result
  is bitwise identical whatever the batch size, the row's position, padding
  rows or chunking (CONTRACT.md section 1), for every implementation except
  ``"xla"``.

  Args:
    a: ``[..., K]``; leading dimensions are flattened into M rows.
    b: ``[K, N]``, or ``[N, K]`` with ``transpose_b=True`` (read in place: a
      tied ``[V, H]`` embedding used as an LM head is never transposed or copied).
    transpose_b: whether ``b`` is laid out ``[N, K]``.
    out_dtype: result dtype (default: the input dtype); e.g. ``jnp.float32``
      to keep the float32 accumulator.
    implementation: ``"mosaic"``, ``"triton"``, ``"cuda"``, ``"cpu"``,
      ``"interpret"``, ``"xla"`` or None (by device: Hopper bf16/fp16 ->
      mosaic, other GPUs and fp32 -> triton, CPU -> cpu).

  Returns:
    ``[..., N]`` in ``out_dtype``.

  Gradients (``jax.custom_vjp``; no forward-mode ``jax.jvp``): ``dA = dC @ B^T``
  and ``dB = A^T @ dC`` run on the same implementation. dA rows are
  batch-invariant; dB is deterministic run to run.

  >>> import jax.numpy as jnp
  >>> a = jnp.ones((3, 8), jnp.float32); b = jnp.ones((8, 2), jnp.float32)
  >>> det_matmul(a, b).tolist()
  [[8.0, 8.0], [8.0, 8.0], [8.0, 8.0]]
  """
  a = jnp.asarray(a)
  b = jnp.asarray(b)
  transpose_b, out_dtype = _validate(a, b, transpose_b, out_dtype)
  k = a.shape[-1]
  n = b.shape[0] if transpose_b else b.shape[1]
  impl = resolve_implementation(implementation, a.dtype, n, k)
  lead = a.shape[:-1]
  a2 = a.reshape(math.prod(lead), k)
  out = _det_matmul2d(a2, b, transpose_b, out_dtype, impl)
  return out.reshape(*lead, n)
