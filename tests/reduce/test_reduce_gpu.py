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
