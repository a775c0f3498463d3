"""The column form of det_sum's kernel (``reduce_triton.reduce_cols``) and the fused RMSNorm
weight gradient (``reduce_triton.product_reduce_cols``), interpreted: bitwise det_sum over
the rows (the transposed row kernel and the XLA form), for every config; det_sum's routing of
leading axes to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal, bits, wide_rows

from jaxrl_kernels.pallas import reduce_triton
from jaxrl_kernels.reduce import REDUCE_LANES, det_prod, det_sum, det_sum_scaled_products

# rows: one, under a lane step, exactly one, several with a remainder; columns: under and
# over the default block, never a multiple of it.
SHAPES = [(1, 7), (5, 33), (REDUCE_LANES, 40), (2 * REDUCE_LANES + 44, 70)]


def _cols(x, **cfg):
  return reduce_triton.reduce_cols(x, op="sum", lanes=REDUCE_LANES, out_dtype=x.dtype,
                                   interpret=True, config=reduce_triton.ColumnConfig(**cfg))


def _columns(key, rows, n, dtype):
  """Columns with a wide dynamic range down the rows (any reordering shows in the bits)."""
  return wide_rows(key, n, rows, dtype).T


@pytest.mark.parametrize("dtype,shape", [("float32", s) for s in SHAPES]
                         + [("bfloat16", s) for s in SHAPES[1::2]]
                         + [("float16", s) for s in SHAPES[::2]])
def test_column_kernel_is_det_sum_over_rows_bitwise(dtype, shape):
  rows, n = shape
  x = _columns(jax.random.key(rows), rows, n, dtype)
  got = _cols(x)
  assert got.dtype == x.dtype and got.shape == (n,)
  rows_kernel = reduce_triton.reduce_rows(x.T, op="sum", lanes=REDUCE_LANES,
                                          out_dtype=x.dtype, interpret=True)
  assert_bitwise_equal(got, rows_kernel, "vs the transposed row kernel")
  assert_bitwise_equal(got, det_sum(x, axis=0, implementation="cpu"), "vs cpu")


def test_column_configs_give_the_same_bits():
  # 11 row steps: unroll 8 leaves 2 single steps, unroll 3 none; 4 lanes per program writes
  # the lane sums for the XLA fold; 8 columns per program leaves a 4-column block.
  x = _columns(jax.random.key(3), 10 * REDUCE_LANES + 9, 20, "float32")
  want = _cols(x, block_lanes=REDUCE_LANES)
  assert reduce_triton.block_lanes_for(20, REDUCE_LANES, reduce_triton.ColumnConfig()) < \
      REDUCE_LANES  # the default splits the lanes of a narrow array over programs
  for cfg in (dict(), dict(block_cols=16, block_lanes=REDUCE_LANES, unroll=3),
              dict(block_cols=8, block_lanes=4, unroll=1)):
    assert_bitwise_equal(_cols(x, **cfg), want, f"{cfg}")
  p = 1.0 + x / (4 * jnp.max(jnp.abs(x)))
  want = det_prod(p.T, axis=1, implementation="interpret")
  for cfg in (dict(block_lanes=REDUCE_LANES, unroll=3), dict(block_cols=8, block_lanes=4)):
    got = reduce_triton.reduce_cols(p, op="prod", lanes=REDUCE_LANES, out_dtype=p.dtype,
                                    interpret=True, config=reduce_triton.ColumnConfig(**cfg))
    assert_bitwise_equal(got, want, f"prod {cfg}")


def test_column_config_errors():
  x = jnp.ones((4, 8))
  for cfg, msg in ((dict(unroll=0), "unroll must be >= 1, got 0"),
                   (dict(block_cols=24), "block_cols must be a power of two, got 24"),
                   (dict(block_lanes=3), "block_lanes must be a power of two dividing")):
    with pytest.raises(ValueError, match=msg):
      _cols(x, **cfg)
  with pytest.raises(ValueError, match="expected g"):
    reduce_triton.product_reduce_cols(x, x, jnp.ones(3), lanes=REDUCE_LANES, interpret=True)
  kw = dict(lanes=REDUCE_LANES, out_dtype=jnp.float32, interpret=True)
  with pytest.raises(ValueError, match="op must be 'sum' or 'prod', got 'max'"):
    reduce_triton.reduce_cols(x, op="max", **kw)
  with pytest.raises(ValueError, match="lanes must be a power of two, got 96"):
    reduce_triton.reduce_cols(x, op="sum", **{**kw, "lanes": 96})
  with pytest.raises(ValueError, match=r"x must be \[R, N\]"):
    reduce_triton.reduce_cols(x[None], op="sum", **kw)


def test_det_sum_over_leading_axes_runs_the_column_kernel():
  x = wide_rows(jax.random.key(4), 3 * 70, 2 * REDUCE_LANES + 1, "float32").T.reshape(-1, 3, 70)
  fn = jax.jit(lambda x: det_sum(x, axis=0, implementation="interpret"))
  assert "kernel_cols" in str(jax.make_jaxpr(fn)(x))
  want = det_sum(jnp.moveaxis(x, 0, -1), axis=-1, implementation="cpu")
  assert_bitwise_equal(fn(x), want, "axis 0 of 3-D")
  y = x.reshape(-1, 5, 42)  # two leading axes, flattened row-major like the row path
  assert_bitwise_equal(det_sum(y, axis=(0, 1), implementation="interpret"),
                       det_sum(y, axis=(0, 1), implementation="cpu"), "axes (0, 1)")
  # short sums (one lane step) stay the element-wise XLA form
  assert "kernel_cols" not in str(jax.make_jaxpr(fn)(x[:REDUCE_LANES]))


def test_gradients_through_the_column_path():
  x = jax.random.uniform(jax.random.key(5), (REDUCE_LANES + 3, 2), minval=0.9, maxval=1.1)
  w = jnp.arange(1.0, 3.0)
  for fn in (det_sum, det_prod):
    grads = [jax.grad(lambda x, i=impl, f=fn: jnp.sum(f(x, axis=0, implementation=i) * w))(x)
             for impl in ("interpret", "cpu")]
    assert_bitwise_equal(grads[0], grads[1], fn.__name__)


def _norm_terms(key, rows, n, dtype, eps=1e-6):
  kg, kx = jax.random.split(key)
  x = _columns(kx, rows, n, dtype)
  g = jax.random.normal(kg, (rows, n)) * 2.0 ** (jnp.arange(rows)[:, None] % 17 - 8)
  g = g.astype(dtype)
  x32 = x.astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + jnp.float32(eps))
  return g, x, rstd, g.astype(jnp.float32) * (x32 * rstd)


@pytest.mark.parametrize("dtype,rows,n", [("float32", 5, 33), ("bfloat16", 300, 70),
                                          ("float16", 2 * REDUCE_LANES, 9)])
def test_fused_norm_dw_is_det_sum_of_the_products(dtype, rows, n):
  g, x, rstd, prod = _norm_terms(jax.random.key(rows), rows, n, dtype)
  got = jax.jit(lambda g, x, r: reduce_triton.product_reduce_cols(
      g, x, r, lanes=REDUCE_LANES, interpret=True))(g, x, rstd[:, 0])
  assert got.dtype == jnp.float32 and got.shape == (n,) and bool(jnp.all(jnp.isfinite(got)))
  want = det_sum(prod, axis=0, implementation="cpu")
  assert_bitwise_equal(got, want, "vs the XLA form")
  assert_bitwise_equal(got, reduce_triton.reduce_rows(
      prod.T, op="sum", lanes=REDUCE_LANES, out_dtype=jnp.float32, interpret=True),
      "vs the row kernel on the written products")


def test_stock_column_sum_differs_on_these_inputs():
  # Control: XLA's own column sum of the same products rounds differently somewhere, and the
  # fused kernel keeps det_sum's bits, not those.
  g, x, rstd, prod = _norm_terms(jax.random.key(300), 300, 70, "bfloat16")
  ours = reduce_triton.product_reduce_cols(g, x, rstd[:, 0], lanes=REDUCE_LANES,
                                           interpret=True)
  stock = jax.jit(lambda p: jnp.sum(p, axis=0))(prod)
  assert not np.array_equal(bits(stock), bits(ours))
  np.testing.assert_allclose(np.asarray(stock), np.asarray(ours), rtol=1e-4)


def test_scaled_products_sum_checks_its_arguments_and_matches_across_implementations():
  g = wide_rows(jax.random.key(7), 200, 33, "float32")
  x = wide_rows(jax.random.key(8), 200, 33, "float32")
  scale = jax.random.uniform(jax.random.key(9), (200,), jnp.float32, 0.5, 2.0)
  want = det_sum(g * (x * scale[:, None]), axis=0, implementation="cpu")
  for impl in ("cpu", "interpret"):
    got = det_sum_scaled_products(g, x, scale, implementation=impl)
    assert_bitwise_equal(got, want, f"{impl} vs det_sum of the written products")
  with pytest.raises(ValueError, match="det_sum_scaled_products: expected g and x"):
    det_sum_scaled_products(g, x, scale[:-1], implementation="cpu")
