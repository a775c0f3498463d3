"""Non-finite scores propagate through ``causal_attention`` on the CPU implementations
("cpu", "interpret"), float32 and bfloat16: NaN in ``q`` at a seen position, NaN or inf in
a seen key, a finite ``q . k`` that overflows give NaN outputs and gradients (stock XLA
attention too: the control), and the rows they cannot reach keep their bits; padding
queries, keys past ``kv_lengths`` and rows of length 0 stay inert and exact zeros. The
GPU kernels run the same checks (tests/attention/test_attention_gpu.py,
test_attention_mosaic_gpu.py); the cases are tests/attention/nonfinite_cases.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from nonfinite_cases import (
    cases,
    check_default_positions_and_decode,
    check_nan_propagates,
    check_unseen_content_is_inert,
)

T, D = 5, 16
IMPLS = ("cpu", "interpret")
DTYPES = (jnp.float32, jnp.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(cases(T)))
def test_non_finite_scores_give_nan(case, impl, dtype):
  check_nan_propagates(impl, dtype, T, D, case)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("impl", IMPLS)
def test_unseen_content_is_inert(impl, dtype):
  check_unseen_content_is_inert(impl, dtype, T, D)


@pytest.mark.parametrize("impl", IMPLS)
def test_default_positions_and_decode_give_nan(impl):
  check_default_positions_and_decode(impl, jnp.float32, T, D)
