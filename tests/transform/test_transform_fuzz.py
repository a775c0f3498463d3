"""Fuzz of ``batch_invariant`` over small user functions: row 0 of the result is bitwise the
same at batch 1 and at batch 8.

Each case draws a chain of two to four steps applied to ``x [B, T, D]`` with a wide
dynamic range: element-wise chains (``exp(x - max)``, ``log``, ``tanh``, ``sigmoid``,
``jax.nn.softmax``, ``a * b + c``), reductions (``jnp.mean`` RMSNorm, ``jnp.sum``,
``jnp.cumsum``) and products of two activations written with ``@`` where ``jnp.matmul``
squeezes size-1 dimensions (``T = 1``, ``D = 1``, an inserted axis of 1). The transformed
function runs in-process (the suite's XLA flags; the default flags are
``test_transform_default_flags.py``'s). The untransformed function is the control: the
module prints at teardown (``pytest -s``) how many cases ran, how many agreed bitwise, and
in how many the control changed bits.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_kernels.transform import batch_invariant

COUNTS: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report():
  yield
  print(f"\ntransform fuzz: {COUNTS['cases']} cases tried, {COUNTS['agree']} bitwise "
        f"agreements (batch 1 vs 8), {COUNTS['control']} controls that differed")


def _swap(x):
  return jnp.swapaxes(x, -1, -2)


STEPS = {
    "exp(x - max)": lambda x: jnp.exp(x - jnp.max(x, -1, keepdims=True)),
    "log": lambda x: jnp.log(jnp.abs(x) + 0.5),
    "tanh": jnp.tanh,
    "sigmoid * x + x": lambda x: jax.nn.sigmoid(x) * x + x,
    "softmax": lambda x: jax.nn.softmax(x, -1),
    "x * x - 3 x": lambda x: x * x - 3.0 * x,
    "rms_norm": lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5),
    "sum": lambda x: x - jnp.sum(x, -1, keepdims=True) / 7.0,
    "cumsum": lambda x: jnp.cumsum(x, -1) * 0.25,
    "x @ x.T @ x": lambda x: (x @ _swap(x)) @ x * 0.125,
    "x[:, None] @ x.T[:, None]": lambda x: (x[:, None] @ _swap(x)[:, None])[:, 0] @ x * 0.125,
}


def _check(fn, x):
  """(row 0 at batch 1 == row 0 at batch 8) for ``fn``."""
  f = jax.jit(fn)
  return np.array_equal(bits(f(x[:1])[0]), bits(f(x)[0]))


@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), t=st.sampled_from([1, 4, 16]), d=st.sampled_from([1, 32, 33]),
       steps=st.lists(st.sampled_from(sorted(STEPS)), min_size=2, max_size=4))
def test_rows_are_bitwise_at_batch_1_and_8(seed, t, d, steps):
  key = jax.random.key(seed)
  x = jax.random.normal(key, (8, t, d), jnp.float32)
  x = x * 2.0 ** jax.random.randint(jax.random.fold_in(key, 1), x.shape, -4, 5)

  def fn(x):
    for name in steps:
      x = STEPS[name](x)
    return x

  COUNTS["cases"] += 1
  assert _check(batch_invariant(fn), x), f"batch_invariant({' -> '.join(steps)}) row 0 changed"
  COUNTS["agree"] += 1
  COUNTS["control"] += not _check(fn, x)
