"""The Triton reduction kernel on a GPU: accuracy, bitwise invariance, and the stock
``jnp.sum`` control."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows

from jaxrl_kernels.reduce import REDUCE_LANES, det_sum
from jaxrl_kernels.reduce import reference as ref


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_triton_sum_accuracy_and_invariance(dtype):
  n = 40 * REDUCE_LANES + 17
  x = wide_rows(jax.random.key(0), 513, n, dtype, spread=4)
  f = jax.jit(lambda x: det_sum(x, axis=1, implementation="triton"))
  full = f(x)
  assert rel_err(full, ref.sum_ref(x, 1)) <= TOL[dtype][0]
  for r in (0, 137, 512):
    assert_bitwise_equal(f(x[r:r + 1]), full[r:r + 1], f"row {r} alone")
  assert_bitwise_equal(f(x[100:300])[37], full[137], "chunk")
  padded = jnp.pad(x[:64], ((0, 0), (0, 2048)))
  assert_bitwise_equal(f(padded), full[:64], "trailing zeros")
  for _ in range(5):
    assert_bitwise_equal(f(x), full, "run to run")


@pytest.mark.gpu
def test_stock_sum_changes_bits_control():
  # XLA's GPU reduction picks its tree from the shape: a row alone, or with
  # trailing zeros, sums in another order.
  x = wide_rows(jax.random.key(1), 4096, 8192 + 17, "float32")
  f = jax.jit(lambda x: jnp.sum(x, axis=1))
  full = np.asarray(f(x))
  alone = np.stack([np.asarray(f(x[r:r + 1]))[0] for r in range(16)])
  padded = np.asarray(f(jnp.pad(x[:16], ((0, 0), (0, 50000)))))
  assert (not np.array_equal(bits(alone), bits(full[:16]))
          or not np.array_equal(bits(padded), bits(full[:16])))
