"""det_sum / det_prod / det_cum*: float64 accuracy, the interpreted kernel equal to the XLA
form, cumulative ops' invariance, gradients, bad input (det_sum's batch, padding,
chunking and trailing-zero invariance: tests/test_contract.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, rel_err, wide_rows

from jaxrl_kernels.reduce import (
  REDUCE_LANES,
  det_cumlogsumexp,
  det_cumprod,
  det_cumsum,
  det_prod,
  det_sum,
)
from jaxrl_kernels.reduce import reference as ref

IMPLS = ("cpu", "interpret")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_sum_matches_float64(dtype, impl):
  x = wide_rows(jax.random.key(0), 6, 300, dtype, spread=4)
  out = det_sum(x, axis=1, implementation=impl)
  assert out.dtype == x.dtype and out.shape == (6,)
  assert rel_err(out, ref.sum_ref(x, 1)) <= TOL[dtype][0]


def test_interpret_kernel_equals_xla_form_bitwise():
  x = wide_rows(jax.random.key(1), 37, 3 * REDUCE_LANES + 5, "float32")
  assert_bitwise_equal(det_sum(x, axis=1, implementation="interpret"),
                       det_sum(x, axis=1, implementation="cpu"), "interpret vs cpu")


def test_inputs_reveal_a_reordering():
  # Control: on these inputs a different summation order changes the bits.
  x = np.asarray(wide_rows(jax.random.key(4), 4, 300, "float32"))
  fwd = np.sum(x, axis=1, dtype=np.float32)
  rev = np.sum(x[:, ::-1], axis=1, dtype=np.float32)
  assert not np.array_equal(fwd, rev)


def test_sum_axes_keepdims_and_empty():
  x = jax.random.normal(jax.random.key(5), (3, 4, 5))
  out = det_sum(x, axis=(0, 2), keepdims=True, implementation="cpu")
  assert out.shape == (1, 4, 1)
  assert rel_err(out[0, :, 0], ref.sum_ref(x, (0, 2))) <= 1e-6
  assert float(det_sum(x, implementation="cpu")) == pytest.approx(float(ref.sum_ref(x)), 1e-5)
  assert det_sum(jnp.zeros((3, 0)), axis=1, implementation="cpu").tolist() == [0.0] * 3


@pytest.mark.parametrize("impl", IMPLS)
def test_sum_and_prod_gradients(impl):
  x = jax.random.uniform(jax.random.key(6), (3, 7), minval=0.5, maxval=1.5)
  g = jax.grad(lambda x: jnp.sum(det_sum(x ** 2, axis=1, implementation=impl) * jnp.arange(3.)))
  np.testing.assert_allclose(g(x), 2 * x * jnp.arange(3.)[:, None], rtol=1e-6)
  assert rel_err(det_prod(x, axis=1, implementation=impl), np.prod(np.float64(x), 1)) <= 1e-6
  gp = jax.grad(lambda x: det_prod(x, implementation=impl))(x[0])
  np.testing.assert_allclose(gp, np.prod(np.float64(x[0])) / np.float64(x[0]), rtol=1e-5)


@pytest.mark.parametrize("op,fn,ref_fn", [
    ("cumsum", det_cumsum, ref.cumsum_ref),
    ("cumprod", det_cumprod, ref.cumprod_ref),
    ("cumlogsumexp", det_cumlogsumexp, ref.cumlogsumexp_ref),
])
@pytest.mark.parametrize("reverse", [False, True])
def test_cumulative_accuracy_and_invariance(op, fn, ref_fn, reverse):
  n = 2 * REDUCE_LANES + 9
  x = jax.random.normal(jax.random.key(7), (4, n))
  if op == "cumprod":
    x = 1.0 + 0.01 * x
  out = fn(x, axis=1, reverse=reverse, implementation="cpu")
  assert out.shape == x.shape and out.dtype == x.dtype
  assert rel_err(out, ref_fn(x, 1, reverse)) <= 1e-5
  assert_bitwise_equal(fn(x[2:3], axis=1, reverse=reverse, implementation="cpu"), out[2:3],
                       "row alone")
  if not reverse:  # element i depends only on x[:i + 1]
    longer = jnp.concatenate([x, jax.random.normal(jax.random.key(8), (4, 300))], axis=1)
    assert_bitwise_equal(fn(longer, axis=1, implementation="cpu")[:, :n], out, "appended")
  # axis other than the last
  out_t = fn(x.T, axis=0, reverse=reverse, implementation="cpu")
  assert_bitwise_equal(out_t, out.T, "axis 0")


def test_bad_input():
  with pytest.raises(TypeError, match="det_sum: x must be one of"):
    det_sum(jnp.arange(4), implementation="cpu")
  with pytest.raises(ValueError, match="det_sum: axis 2 is out of range"):
    det_sum(jnp.ones((2, 3)), axis=2, implementation="cpu")
  with pytest.raises(ValueError, match="repeats an axis"):
    det_sum(jnp.ones((2, 3)), axis=(1, -1), implementation="cpu")
  with pytest.raises(TypeError, match="reverse must be a bool"):
    det_cumsum(jnp.ones(3), reverse=1, implementation="cpu")
  with pytest.raises(ValueError, match="implementation"):
    det_sum(jnp.ones(3), implementation="nonsense")


# Rows per program, lane steps per loop iteration: knobs that must not move a bit. 12 lane
# steps: unroll 8 leaves 4 single steps, unroll 3 none, unroll 1 is one step per iteration.
_CONFIGS = [dict(block_rows=1, unroll=1), dict(block_rows=2, unroll=3), dict(),
            dict(block_rows=16, unroll=8), dict(block_rows=4, unroll=16)]


@pytest.mark.parametrize("op", ["sum", "prod"])
def test_every_kernel_config_gives_the_xla_form_bits(op):
  from jaxrl_kernels.pallas import reduce_triton
  from jaxrl_kernels.reduce import fixed_order

  x = wide_rows(jax.random.key(2), 19, 11 * REDUCE_LANES + 5, "float32")
  if op == "prod":  # products near 1 stay finite over 1413 terms
    x = 1.0 + x / (4 * jnp.max(jnp.abs(x)))
  want = fixed_order.reduce_rows(x, op=op, lanes=REDUCE_LANES, out_dtype=x.dtype)
  for cfg in _CONFIGS if op == "sum" else _CONFIGS[:2]:
    got = reduce_triton.reduce_rows(x, op=op, lanes=REDUCE_LANES, out_dtype=x.dtype,
                                    interpret=True, config=reduce_triton.Config(**cfg))
    assert_bitwise_equal(got, want, f"{op} {cfg}")


def test_kernel_config_errors():
  from jaxrl_kernels.pallas import reduce_triton

  x = jnp.ones((4, 8))
  with pytest.raises(ValueError, match="unroll must be >= 1, got 0"):
    reduce_triton.reduce_rows(x, op="sum", lanes=REDUCE_LANES, out_dtype=x.dtype, interpret=True,
                              config=reduce_triton.Config(unroll=0))
  with pytest.raises(ValueError, match="block_rows must be a power of two, got 3"):
    reduce_triton.reduce_rows(x, op="sum", lanes=REDUCE_LANES, out_dtype=x.dtype, interpret=True,
                              config=reduce_triton.Config(block_rows=3))
  # a few long rows spread over many programs; many rows take 16 per program
  assert reduce_triton.block_rows_for(2048, reduce_triton.Config()) == 4
  assert reduce_triton.block_rows_for(64, reduce_triton.Config()) == 1
  assert reduce_triton.block_rows_for(32768, reduce_triton.Config()) == 16


@pytest.mark.parametrize("op", ["sum", "prod"])
def test_short_rows_take_the_elementwise_form_with_the_kernel_bits(op):
  # Rows of at most one lane step (sums over size-1 axes: a gradient's broadcast dims,
  # GQA's repeat) fold from the next power of two in XLA; the kernel folds all lanes.
  from jaxrl_kernels.pallas import reduce_triton
  from jaxrl_kernels.reduce import fixed_order

  for n in (1, 2, 3, 5, 64, 100, REDUCE_LANES):
    x = wide_rows(jax.random.key(n), 9, n, "float32")
    x = x.at[0].set(-0.0).at[1, 0].set(-0.0)  # -0.0 + 0.0 is +0.0 in both forms
    if op == "prod":
      x = 1.0 + x / (4 * jnp.max(jnp.abs(x)))
    want = reduce_triton.reduce_rows(x, op=op, lanes=REDUCE_LANES, out_dtype=x.dtype,
                                     interpret=True)
    got = fixed_order.reduce_rows(x, op=op, lanes=REDUCE_LANES, out_dtype=x.dtype)
    assert_bitwise_equal(got, want, f"{op} n={n}")
    fn = det_sum if op == "sum" else det_prod
    assert_bitwise_equal(fn(x, axis=1, implementation="interpret"), want, f"{op} api n={n}")
