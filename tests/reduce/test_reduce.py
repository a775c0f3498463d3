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
