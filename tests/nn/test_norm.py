"""``nn.rms_norm`` / ``nn.add_rms_norm`` and ``gemm.row_parallel_partials``: float64
accuracy, rows independent of the batch (bitwise), the fused residual add equal to the
separate ops bitwise, gradients, bad input. The GPU kernel: the same claims, compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, rel_err, wide_rows

from jaxrl_kernels.gemm import row_parallel_matmul, row_parallel_partials
from jaxrl_kernels.gemm.row_parallel import pairwise_tree
from jaxrl_kernels.nn import add_rms_norm, rms_norm
from jaxrl_kernels.pallas import rmsnorm_triton

EPS = 1e-6


def _ref(x, w, eps=EPS):
  x = np.asarray(x, np.float64)
  return np.asarray(w, np.float64) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _inputs(rows, n, dtype, seed=0):
  x = wide_rows(jax.random.key(seed), rows, n, dtype, spread=3)
  w = (1 + 0.3 * jax.random.normal(jax.random.key(seed + 1), (n,))).astype(dtype)
  return x, w


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("impl", ["cpu", "interpret", "xla"])
@pytest.mark.parametrize("n", [896, 64, 100])
def test_rms_norm_matches_float64(impl, dtype, n):
  x, w = _inputs(9, n, dtype)
  y = rms_norm(x, w, eps=EPS, implementation=impl)
  assert y.dtype == x.dtype and y.shape == x.shape
  assert rel_err(y, _ref(x, w)) <= TOL[dtype][0]


@pytest.mark.parametrize("impl", ["cpu", "interpret"])
def test_rows_do_not_depend_on_the_batch(impl):
  x, w = _inputs(37, 896, "bfloat16")
  full = rms_norm(x, w, eps=EPS, implementation=impl)
  for r in (0, 5, 36):
    assert_bitwise_equal(rms_norm(x[r:r + 1], w, eps=EPS, implementation=impl), full[r:r + 1],
                         f"row {r} alone")
  # Leading axes are rows too: [B, T, N] gives the [B*T, N] bits.
  assert_bitwise_equal(rms_norm(x[:36].reshape(4, 9, 896), w, eps=EPS, implementation=impl),
                       full[:36].reshape(4, 9, 896), "3-D")


def test_kernel_equals_the_xla_form_bitwise():
  """The interpreted kernel runs the ``cpu`` form's operations in the same order."""
  x, w = _inputs(11, 1000, "float32")
  assert_bitwise_equal(rms_norm(x, w, eps=EPS, implementation="interpret"),
                       rms_norm(x, w, eps=EPS, implementation="cpu"), "interpret vs cpu")


def test_block_rows_depend_on_n_only():
  assert rmsnorm_triton.block_rows_for(896) == rmsnorm_triton.block_rows_for(896)
  assert rmsnorm_triton.width_for(896) == 1024 and rmsnorm_triton.width_for(1024) == 1024
  assert rmsnorm_triton.block_rows_for(4096) == 1 and rmsnorm_triton.block_rows_for(64) == 32


def _layer(rows, k, n, dtype, chunks=8, bias=True, seed=3):
  keys = jax.random.split(jax.random.key(seed), 4)
  a = wide_rows(keys[0], rows, k, dtype, spread=3)
  w = (jax.random.normal(keys[1], (k, n)) * 0.05).astype(dtype)
  b = (jax.random.normal(keys[2], (n,)) * 0.1).astype(dtype) if bias else None
  x = jax.random.normal(keys[3], (rows, n)).astype(dtype)
  return a, w, b, x


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("impl", ["cpu", "interpret"])
def test_add_rms_norm_equals_add_then_norm_bitwise(impl, bias):
  a, w, b, x = _layer(13, 256, 96, "bfloat16", bias=bias)
  norm_w = (1 + 0.2 * jax.random.normal(jax.random.key(9), (96,))).astype(jnp.bfloat16)
  parts = row_parallel_partials(a, w, chunks=8, implementation=impl)
  assert parts.shape == (8, 13, 96) and parts.dtype == jnp.float32
  x_new, y = add_rms_norm(x, parts, norm_w, eps=EPS, bias=b, implementation=impl)
  x_ref = x + row_parallel_matmul(a, w, b, chunks=8, implementation=impl)
  assert_bitwise_equal(x_new, x_ref, "x + row_parallel_matmul")
  assert_bitwise_equal(y, rms_norm(x_ref, norm_w, eps=EPS, implementation=impl), "norm")


@pytest.mark.parametrize("impl", ["cpu", "interpret"])
def test_partials_are_the_row_parallel_products(impl):
  a, w, b, _ = _layer(5, 128, 64, "float32")
  parts = row_parallel_partials(a, w, chunks=4, implementation=impl)
  got = (pairwise_tree(list(parts)) + b).astype(a.dtype)
  assert_bitwise_equal(got, row_parallel_matmul(a, w, b, chunks=4, implementation=impl),
                       "tree of partials + bias")
  ref = np.asarray(a, np.float64).reshape(5, 4, 32).transpose(1, 0, 2) @ np.asarray(
      w, np.float64).reshape(4, 32, 64)
  assert rel_err(parts, ref) <= TOL["float32"][0]


@pytest.mark.parametrize("impl", ["cpu", "interpret"])
def test_gradients_match_float64(impl):
  x, w = _inputs(6, 96, "float32")
  g = jax.random.normal(jax.random.key(4), x.shape)

  def ref(x, w):
    return jnp.sum(g * w * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS))

  with jax.enable_x64():
    want = jax.grad(ref, (0, 1))(np.asarray(x, np.float64), np.asarray(w, np.float64))
  got = jax.grad(lambda x, w: jnp.sum(g * rms_norm(x, w, eps=EPS, implementation=impl)),
                 (0, 1))(x, w)
  for a, b, what in zip(got, want, ("dx", "dw"), strict=True):
    assert rel_err(a, b) <= TOL["float32"][1], what


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_weight_gradient_is_the_cpu_one_bitwise(dtype):
  # The kernel implementations sum g * y over rows in the column-sum kernel, from g, x and
  # the rows' rstd; "cpu" writes g * y and runs det_sum: the same bits. 2 x 70 rows: more
  # than one lane step, and not a multiple of one.
  x, w = _inputs(140, 40, dtype, seed=11)
  x = x.reshape(2, 70, 40)
  g = wide_rows(jax.random.key(12), 140, 40, dtype, spread=6).reshape(x.shape)
  grads = {impl: jax.jit(jax.grad(
      lambda x, w, i=impl: jnp.sum(g.astype(jnp.float32) * rms_norm(
          x, w, eps=EPS, implementation=i).astype(jnp.float32)), (0, 1)))(x, w)
      for impl in ("interpret", "cpu")}
  assert_bitwise_equal(grads["interpret"][1], grads["cpu"][1], "dw")
  assert_bitwise_equal(grads["interpret"][0], grads["cpu"][0], "dx")
  # add_rms_norm's bias gradient: det_sum over rows by the column kernel for "interpret"
  parts = jnp.stack([x.astype(jnp.float32), -0.5 * x.astype(jnp.float32)])
  bias = jnp.linspace(-1.0, 1.0, 40)
  db = {impl: jax.grad(lambda b, i=impl: jnp.sum(
      g.astype(jnp.float32) * add_rms_norm(x, parts, w, eps=EPS, bias=b, implementation=i)[1]
      .astype(jnp.float32)))(bias) for impl in ("interpret", "cpu")}
  assert_bitwise_equal(db["interpret"], db["cpu"], "bias")


@pytest.mark.parametrize("impl", ["cpu", "interpret"])
def test_add_rms_norm_gradients_match_the_separate_ops(impl):
  a, w, b, x = _layer(7, 128, 64, "float32", chunks=4)
  norm_w = 1 + 0.2 * jax.random.normal(jax.random.key(9), (64,))
  g1, g2 = jax.random.normal(jax.random.key(5), (2, 7, 64))

  def fused(x, a, w, b, nw):
    x_new, y = add_rms_norm(x, row_parallel_partials(a, w, chunks=4, implementation=impl), nw,
                            eps=EPS, bias=b, implementation=impl)
    return jnp.sum(g1 * x_new) + jnp.sum(g2 * y)

  def separate(x, a, w, b, nw):
    x_new = x + row_parallel_matmul(a, w, b, chunks=4, implementation=impl)
    return jnp.sum(g1 * x_new) + jnp.sum(g2 * rms_norm(x_new, nw, eps=EPS, implementation=impl))

  got = jax.grad(fused, range(5))(x, a, w, b, norm_w)
  want = jax.grad(separate, range(5))(x, a, w, b, norm_w)
  for name, u, v in zip(("x", "a", "w", "bias", "norm weight"), got, want, strict=True):
    assert rel_err(u, v) <= 1e-6, name


def test_bad_input_names_the_argument():
  x, w = _inputs(2, 8, "float32")
  with pytest.raises(ValueError, match="weight must have shape"):
    rms_norm(x, w[:4], eps=EPS)
  with pytest.raises(ValueError, match="eps"):
    rms_norm(x, w, eps=-1.0)
  with pytest.raises(TypeError, match="x must have dtype"):
    rms_norm(x.astype(jnp.int32), w, eps=EPS)
  with pytest.raises(TypeError, match="partials must be float32"):
    add_rms_norm(x, jnp.zeros((2, 2, 8), jnp.bfloat16), w, eps=EPS)
  with pytest.raises(ValueError, match="partials must have shape"):
    add_rms_norm(x, jnp.zeros((3, 2, 8)), w, eps=EPS)
  with pytest.raises(ValueError, match="bias must have shape"):
    add_rms_norm(x, jnp.zeros((2, 2, 8)), w, eps=EPS, bias=jnp.zeros((3,)))
  with pytest.raises(ValueError, match="chunks must be a power of two"):
    row_parallel_partials(x, jnp.zeros((8, 4)), chunks=3)
  with pytest.raises(ValueError, match="K=8 must be a multiple of chunks=16"):
    row_parallel_partials(x, jnp.zeros((8, 4)), chunks=16)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [896, 2048, 1536])
def test_kernel_on_the_gpu(n):
  """Compiled: float64 accuracy, rows batch-invariant, and the fused kernel's norm equal to
  the plain kernel's for the same residual (the two compile to different programs)."""
  a, w, b, x = _layer(300, 512, n, "bfloat16")
  norm_w = (1 + 0.2 * jax.random.normal(jax.random.key(9), (n,))).astype(jnp.bfloat16)
  y = rms_norm(x, norm_w, eps=EPS, implementation="triton")
  assert rel_err(y, _ref(x, norm_w)) <= TOL["bfloat16"][0]
  for rows in (1, 64, 299):
    assert_bitwise_equal(rms_norm(x[:rows], norm_w, eps=EPS, implementation="triton"),
                         y[:rows], f"first {rows} rows")
  parts = row_parallel_partials(a, w, chunks=8, implementation="mosaic")
  x_new, y2 = add_rms_norm(x, parts, norm_w, eps=EPS, bias=b, implementation="triton")
  x_ref = x + row_parallel_matmul(a, w, b, chunks=8, implementation="mosaic")
  assert_bitwise_equal(x_new, x_ref, "x + row_parallel_matmul")
  assert_bitwise_equal(y2, rms_norm(x_ref, norm_w, eps=EPS, implementation="triton"),
                       "fused vs plain norm")
  x_new1, y1 = add_rms_norm(x[:1], parts[:, :1], norm_w, eps=EPS, bias=b,
                            implementation="triton")
  assert_bitwise_equal(y1, y2[:1], "fused, one row")
