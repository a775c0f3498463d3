"""``det_matmul``: the batch-invariant deterministic GEMM (forward and backward)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxrl_kernels import _backend

_FLOAT_DTYPES = ("bfloat16", "float16", "float32")
_SUPPORTED = ("mosaic", "triton", "interpret", "cuda", "xla")


def _gemm2d(lhs, rhs, *, lhs_transposed: bool, rhs_transposed: bool, out_dtype,
            implementation: str) -> jax.Array:
  """Dispatches one 2-D product ``op(lhs) @ op(rhs)`` to a backend kernel.

  Which kernel runs may depend on N, K and dtype (fixed for a given weight)
  but never on M, so a row's bits never depend on its batch.
  """
  m = lhs.shape[1] if lhs_transposed else lhs.shape[0]
  n = rhs.shape[0] if rhs_transposed else rhs.shape[1]
  k = lhs.shape[0] if lhs_transposed else lhs.shape[1]
  if m == 0 or n == 0:
    return jnp.zeros((m, n), out_dtype)
  if k == 0:
    return jnp.zeros((m, n), out_dtype)
  if implementation == "xla":
    a = lhs.T if lhs_transposed else lhs
    b = rhs.T if rhs_transposed else rhs
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(out_dtype)
  kw = dict(lhs_transposed=lhs_transposed, rhs_transposed=rhs_transposed, out_dtype=out_dtype)
  if implementation == "mosaic":
    from jaxrl_kernels.pallas import gemm_mosaic
    if lhs_transposed:
      # dB = A^T dC reduces over tokens: its kernel may depend on M (dB is only
      # run-to-run deterministic, never batch-invariant).
      cfg = gemm_mosaic.default_config(m, n, k)
      ok = gemm_mosaic.supported_shape(m, n, -(-k // 64) * 64, cfg, lhs_transposed=True,
                                       rhs_transposed=rhs_transposed) is None
    else:
      ok = _mosaic_can_run(n, k)  # by N and K only: the same kernel for every M
    if ok:
      return gemm_mosaic.matmul(lhs, rhs, **kw)
    implementation = "triton"
  if implementation == "cuda":
    from jaxrl_kernels.custom_calls import gemm_ffi
    return gemm_ffi.matmul_cuda(lhs, rhs, **kw)
  from jaxrl_kernels.pallas import gemm_triton
  return gemm_triton.matmul(lhs, rhs, interpret=implementation == "interpret", **kw)


def _mosaic_can_run(n: int, k: int) -> bool:
  """Whether the Mosaic kernel takes this weight shape (decided by N and K only)."""
  from jaxrl_kernels.pallas import gemm_mosaic
  for m in (1, 128, 4096):  # every M-dependent config must accept the weight
    cfg = gemm_mosaic.default_config(m, n, k)
    if gemm_mosaic.supported_shape(m, n, k, cfg, lhs_transposed=False,
                                   rhs_transposed=False) is not None:
      return False
  return True


def _validate(a, b, transpose_b: bool, out_dtype):
  if not isinstance(transpose_b, bool):
    raise TypeError(f"det_matmul: transpose_b must be a bool, got {transpose_b!r}")
  if a.ndim < 1:
    raise ValueError(f"det_matmul: a must have at least 1 dimension [..., K], got shape {a.shape}")
  if b.ndim != 2:
    raise ValueError(f"det_matmul: b must be 2-D ([K, N], or [N, K] with transpose_b=True), "
                     f"got shape {b.shape}")
  for name, x in (("a", a), ("b", b)):
    if jnp.dtype(x.dtype).name not in _FLOAT_DTYPES:
      raise TypeError(f"det_matmul: {name} must be one of {_FLOAT_DTYPES}, got {x.dtype}")
  if a.dtype != b.dtype:
    raise TypeError(f"det_matmul: a and b must have the same dtype, got a {a.dtype} and b "
                    f"{b.dtype}; cast one explicitly")
  k_b = b.shape[1] if transpose_b else b.shape[0]
  if a.shape[-1] != k_b:
    layout = "[N, K]" if transpose_b else "[K, N]"
    raise ValueError(f"det_matmul: a has K={a.shape[-1]} (shape {a.shape}) but b {layout} has "
                     f"K={k_b} (shape {b.shape})")
  if out_dtype is not None and jnp.dtype(out_dtype).name not in _FLOAT_DTYPES:
    raise TypeError(f"det_matmul: out_dtype must be one of {_FLOAT_DTYPES}, got {out_dtype}")


def resolve_implementation(implementation: str | None, dtype, n: int, k: int) -> str:
  """The implementation ``det_matmul`` runs for a weight of shape K x N."""
  impl = _backend.resolve("det_matmul", implementation, dtype, supported=_SUPPORTED)
  if impl == "mosaic" and not _mosaic_can_run(n, k):
    if implementation == "mosaic":
      raise ValueError(f"det_matmul: implementation='mosaic' needs K and N multiples of 64 "
                       f"(N >= 128); got K={k}, N={n}. Use implementation='triton'")
    impl = "triton"  # by weight shape only: the same for every batch size
  return impl


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _det_matmul2d(a, b, transpose_b, out_dtype, implementation):
  return _gemm2d(a, b, lhs_transposed=False, rhs_transposed=transpose_b, out_dtype=out_dtype,
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
  da = _gemm2d(g, b, lhs_transposed=False, rhs_transposed=not transpose_b, out_dtype=a.dtype,
               implementation=implementation)
  # dB = A^T @ dC (or dC^T @ A for a [N, K] weight): a reduction over tokens,
  # deterministic run to run; it depends on the batch by its nature.
  if transpose_b:
    db = _gemm2d(g, a, lhs_transposed=True, rhs_transposed=False, out_dtype=b.dtype,
                 implementation=implementation)
  else:
    db = _gemm2d(a, g, lhs_transposed=True, rhs_transposed=False, out_dtype=b.dtype,
                 implementation=implementation)
  return da, db


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
    implementation: ``"mosaic"``, ``"triton"``, ``"interpret"``, ``"cuda"``,
      ``"xla"`` or None (by device: Hopper bf16/fp16 -> mosaic, other GPUs and
      fp32 -> triton, CPU -> interpret).

  Returns:
    ``[..., N]`` in ``out_dtype``.

  Gradients (``jax.custom_vjp``): ``dA = dC @ B^T`` and ``dB = A^T @ dC`` run
  on the same deterministic kernels. dA rows are batch-invariant; dB is
  deterministic run to run.

  >>> import jax.numpy as jnp
  >>> a = jnp.ones((3, 8), jnp.float32); b = jnp.ones((8, 2), jnp.float32)
  >>> det_matmul(a, b, implementation="interpret").tolist()
  [[8.0, 8.0], [8.0, 8.0], [8.0, 8.0]]
  """
  a = jnp.asarray(a)
  b = jnp.asarray(b)
  _validate(a, b, transpose_b, out_dtype)
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  k = a.shape[-1]
  n = b.shape[0] if transpose_b else b.shape[1]
  impl = resolve_implementation(implementation, a.dtype, n, k)
  lead = a.shape[:-1]
  a2 = a.reshape(math.prod(lead), k)
  out = _det_matmul2d(a2, b, transpose_b, out_dtype, impl)
  return out.reshape(*lead, n)
