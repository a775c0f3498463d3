"""det_sum's Triton kernel on a CUDA GPU: accuracy against float64 in every input dtype.

Its invariance (batch, position, padding, chunking, trailing zeros, mode, run to run) and
the stock ``jnp.sum`` control are tests/test_contract.py."""

import jax
import pytest
from helpers import TOL, rel_err, wide_rows

from jaxrl_kernels.reduce import REDUCE_LANES, det_sum
from jaxrl_kernels.reduce import reference as ref


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_triton_sum_accuracy(dtype):
  n = 40 * REDUCE_LANES + 17
  x = wide_rows(jax.random.key(0), 513, n, dtype, spread=4)
  full = jax.jit(lambda x: det_sum(x, axis=1, implementation="triton"))(x)
  assert full.dtype == x.dtype and full.shape == (513,)
  assert rel_err(full, ref.sum_ref(x, 1)) <= TOL[dtype][0]


@pytest.mark.gpu
def test_triton_configs_give_the_xla_form_bits_gpu():
  # A log-softmax-sized row set (2053 rows of a 128256 vocabulary) and many short rows:
  # every tuning config, and the plain-XLA form of the same order, give one bit pattern.
  import numpy as np

  from jaxrl_kernels.pallas import reduce_triton
  from jaxrl_kernels.reduce import fixed_order

  for rows, n in ((2053, 128256), (4099, 2048 + 3)):
    x = wide_rows(jax.random.key(rows), rows, n, "float32")
    want = np.asarray(jax.jit(lambda x: fixed_order.reduce_rows(
        x, op="sum", lanes=REDUCE_LANES, out_dtype=x.dtype))(x))
    for cfg in (dict(block_rows=1, unroll=1), dict(), dict(block_rows=16, unroll=4),
                dict(num_stages=1, num_warps=8)):
      c = reduce_triton.Config(**cfg)
      got = jax.jit(lambda x, c=c: reduce_triton.reduce_rows(
          x, op="sum", lanes=REDUCE_LANES, out_dtype=x.dtype, interpret=False, config=c))(x)
      np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32),
                                    err_msg=f"rows={rows} n={n} {cfg}")
