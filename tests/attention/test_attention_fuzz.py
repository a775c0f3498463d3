"""Property-based fuzz of ``causal_attention`` on the CPU implementations ("cpu",
"interpret"), float32 and bfloat16: non-finite scores propagate, unseen content is inert,
bad arguments are refused by name.

Each example draws positions per batch row (plain, shifted with padding queries at -1,
all padding, decreasing, restarting), ``kv_lengths`` in ``[0, S]`` and one corruption of
``q`` or ``k`` (NaN, +-inf, 1e20: a finite ``q . k`` may overflow) at a drawn place, seen or
not, and asserts:

* agreement with the float64 reference (``attention_reference``), NaN where it is NaN and
  nowhere else (a NaN or inf score of a seen key makes the row NaN; which keys a row sees
  comes from its position and length, never from the softmax denominator), and the stock
  ``"xla"`` control NaN in the same rows;
* isolation: every row that does not see the corrupted value keeps the bits of the clean
  call, outputs and (other batch rows) gradients; rows that see no key are exact +0;
* a named error for malformed positions, lengths and scales.

Bounded for CI (``derandomize=True``, few examples, one shape so that the compiled
programs are reused). The module prints its counts at teardown (``pytest -s``).
"""

from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal, fuzz
from hypothesis import given
from hypothesis import strategies as st
from nonfinite_cases import HKV, HQ, run

from jaxrl_kernels.attention import causal_attention
from jaxrl_kernels.attention.reference import attention_reference

COUNTS: collections.Counter = collections.Counter()
B, T, D = 3, 5, 16
POSITIONS = {
    "plain": np.arange(T), "padded": np.arange(-1, T - 1), "two_pads": np.arange(-2, T - 2),
    "all_pad": -np.ones(T), "decreasing": np.arange(T)[::-1], "restart": np.r_[0, 1, 0, 1, 2],
}
VALUES = (float("nan"), float("inf"), -float("inf"), 1e20)
ATOL = {"float32": 1e-4, "bfloat16": 3e-2}  # times max |v|


@pytest.fixture(scope="module", autouse=True)
def _counts():
  yield
  print(f"\nattention fuzz: {COUNTS['cases']} cases tried, {COUNTS['named']} named errors, "
        f"{COUNTS['agree']} agreements with float64, {COUNTS['isolated']} isolation checks")


def _inputs(seed, dtype):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, HQ, D))
  k = rng.standard_normal((B, T, HKV, D))
  v = rng.standard_normal((B, T, HKV, D)) * 2.0 ** rng.integers(-6, 7, (B, T, HKV, 1))
  d_out = rng.standard_normal((B, T, HQ, D))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v, d_out))


def _row_nan(x):
  return np.isnan(np.asarray(x, np.float64)).any(-1)  # [B, T, Hq]


@fuzz(14)
@given(impl=st.sampled_from(("cpu", "interpret")), dtype=st.sampled_from(("float32", "bfloat16")),
       rows=st.lists(st.sampled_from(sorted(POSITIONS)), min_size=B, max_size=B),
       kvl=st.lists(st.integers(0, T), min_size=B, max_size=B),
       where=st.sampled_from(("q", "k")), b=st.integers(0, B - 1), i=st.integers(0, T - 1),
       h=st.integers(0, HQ - 1), col=st.sampled_from((0, 5, None)),
       value=st.sampled_from(VALUES), seed=st.integers(0, 3))
def test_fuzz_non_finite_scores(impl, dtype, rows, kvl, where, b, i, h, col, value, seed):
  COUNTS["cases"] += 1
  q, k, v, d_out = _inputs(seed, dtype)
  pos = jnp.asarray(np.stack([POSITIONS[r] for r in rows]), jnp.int32)
  kvl = jnp.asarray(kvl, jnp.int32)
  cols = slice(None) if col is None else col
  if where == "q":
    qb, kb = q.at[b, i, h, cols].set(value), k
  else:
    qb, kb = q, k.at[b, i, h % HKV, cols].set(value)
  clean_out, clean_grads = run(impl, q, k, v, pos, kvl, d_out)
  out, grads = run(impl, qb, kb, v, pos, kvl, d_out)
  stock, _ = run("xla", qb, kb, v, pos, kvl, d_out)
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
  ref = attention_reference(f64(qb), f64(kb), f64(v), np.asarray(pos), np.asarray(kvl),
                            D ** -0.5)
  out64 = f64(out)
  # NaN exactly where the float64 truth is NaN (and the stock control agrees).
  np.testing.assert_array_equal(_row_nan(out64), _row_nan(ref), err_msg=f"{impl} NaN rows")
  np.testing.assert_array_equal(_row_nan(f64(stock)), _row_nan(ref), err_msg="stock NaN rows")
  ok = ~np.isnan(ref)
  tol = ATOL[dtype] * float(np.max(np.abs(f64(v))))
  assert np.all(np.abs(out64[ok] - ref[ok]) <= tol), f"{impl}: off the float64 reference"
  COUNTS["agree"] += 1
  for g, name in zip(grads[0:1], ("dq",)):
    assert np.all(np.isnan(f64(g))[_row_nan(ref)]), f"{impl}: {name} of a NaN row"
  # Isolation: rows that cannot see the corrupted value keep their bits.
  p = np.asarray(pos)
  last = np.minimum(p, np.asarray(kvl)[:, None] - 1)  # [B, T]
  reach = np.zeros((B, T, HQ), bool)
  if where == "q":
    reach[b, i, h] = last[b, i] >= 0
  else:
    reach[b, :, [hh for hh in range(HQ) if hh // (HQ // HKV) == h % HKV]] = (last[b] >= i)[None]
  same = ~reach
  assert_bitwise_equal(np.asarray(out)[same], np.asarray(clean_out)[same], f"{impl}: isolation")
  others = [x for x in range(B) if x != b]
  for a, c in zip(grads, clean_grads):
    assert_bitwise_equal(np.asarray(a)[others], np.asarray(c)[others], f"{impl}: gradients")
  unseen = last < 0
  assert np.all(np.asarray(out, np.float32)[unseen].view(np.uint32) == 0)
  assert np.all(np.asarray(grads[0], np.float32)[unseen].view(np.uint32) == 0)
  COUNTS["isolated"] += 1


@fuzz(8)
@given(bad=st.sampled_from(("pos_float", "pos_shape", "kvl_shape", "kvl_float", "scale_nan",
                            "scale_neg", "dtype_mix", "heads")),
       impl=st.sampled_from(("cpu", "interpret")))
def test_fuzz_bad_arguments_are_named(bad, impl):
  COUNTS["cases"] += 1
  q, k, v, _ = _inputs(0, "float32")
  pos, kvl, scale = jnp.zeros((B, T), jnp.int32), jnp.full((B,), T, jnp.int32), None
  name = {"pos_float": "q_positions", "pos_shape": "q_positions", "kvl_shape": "kv_lengths",
          "kvl_float": "kv_lengths", "scale_nan": "scale", "scale_neg": "scale",
          "dtype_mix": "dtype", "heads": "heads"}[bad]
  if bad == "pos_float":
    pos = pos.astype(jnp.float32)
  elif bad == "pos_shape":
    pos = pos[:, :-1]
  elif bad == "kvl_shape":
    kvl = kvl[:-1]
  elif bad == "kvl_float":
    kvl = kvl.astype(jnp.float32)
  elif bad == "scale_nan":
    scale = float("nan")
  elif bad == "scale_neg":
    scale = -1.0
  elif bad == "dtype_mix":
    v = v.astype(jnp.bfloat16)
  else:
    q = q[:, :, :1].repeat(3, axis=2)  # 3 query heads over 2 kv heads
    k = v = jnp.concatenate([k, k], axis=2)
  with pytest.raises((ValueError, TypeError)) as e:
    causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl, scale=scale, implementation=impl)
  assert name in str(e.value), f"message does not name {name!r}: {e.value}"
  COUNTS["named"] += 1
