"""Non-finite scores in ``causal_attention``: the cases and their checks, shared by the CPU
tests (tests/attention/test_attention_nonfinite.py) and the GPU ones.

Which keys a query sees is decided from positions and lengths; a NaN or inf score (NaN or
inf in ``q`` or in a seen key, or a finite ``q . k`` that overflows) makes the query's
output and its gradients NaN, as stock softmax attention does. Rows the corruption cannot
reach keep their bits; padding queries, rows of length 0 and keys past ``kv_lengths`` stay
inert whatever they hold.

The batch: row 0 a plain sequence (positions ``0..T-1``, all keys); row 1 a padding query
(position -1) then positions ``0..T-2`` with ``kv_lengths = T - 2``; row 2 length 0 (no
query sees a key). Two query heads share one kv head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_bitwise_equal

from jaxrl_kernels.attention import causal_attention

HQ, HKV = 2, 1
NAN, INF = float("nan"), float("inf")


def batch(dtype, t, d, seed=0):
  """``q, k, v, pos, kvl, d_out``; ``q[..., 0] >= 0.5`` so that an inf in ``k[..., 0]``
  gives a ``+inf`` score."""
  k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(k1, (3, t, HQ, d))
  q = q.at[..., 0].set(jnp.abs(q[..., 0]) + 0.5)
  k = jax.random.normal(k2, (3, t, HKV, d))
  v = jax.random.normal(k3, (3, t, HKV, d)) * 2.0 ** jax.random.randint(
      k4, (3, t, HKV, 1), -8, 9).astype(jnp.float32)
  d_out = jax.random.normal(k5, (3, t, HQ, d))
  pos = np.stack([np.arange(t), np.arange(-1, t - 1), np.arange(t)]).astype(np.int32)
  kvl = np.array([t, t - 2, 0], np.int32)
  return (*(x.astype(dtype) for x in (q, k, v)), jnp.asarray(pos), jnp.asarray(kvl),
          d_out.astype(dtype))


def cases(t):
  """``name -> (corrupt(q, k) -> (q, k), nan queries of row 0 [(i, h)], keys of row 0
  whose dk/dv are NaN, queries of row 0 whose output keeps its bits [(i, h)])``.
  ``j = 1`` is a key that queries ``1..T-1`` see."""
  every = [(i, h) for i in range(1, t) for h in range(HQ)]
  return {
      "nan_in_q": (lambda q, k: (q.at[0, 2, 0, 3].set(NAN), k), [(2, 0)], range(3),
                   [(i, h) for i in range(t) for h in range(HQ) if (i, h) != (2, 0)]),
      "nan_in_seen_k": (lambda q, k: (q, k.at[0, 1, 0, 5].set(NAN)), every, range(t),
                        [(0, 0), (0, 1)]),
      "inf_in_seen_k": (lambda q, k: (q, k.at[0, 1, 0, 0].set(INF)), every, range(t),
                        [(0, 0), (0, 1)]),
      # Every product 1e40 overflows float32 (and bfloat16): the score is +inf.
      "overflowing_qk": (lambda q, k: (q.at[0, 2, 0].set(1e20), k.at[0, 1, 0].set(1e20)),
                         [(2, 0)], range(3), [(0, 0), (0, 1)]),
  }


@functools.partial(jax.jit, static_argnums=0)
def _run(impl, q, k, v, pos, kvl, d_out):
  f = lambda q, k, v: causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl,  # noqa: E731
                                       implementation=impl)
  out, vjp = jax.vjp(f, q, k, v)
  return out, vjp(d_out)


def run(impl, q, k, v, pos, kvl, d_out):
  """``(out, (dq, dk, dv))`` as numpy arrays in the op's dtype (one program per impl and
  shape, reused by every case)."""
  out, grads = _run(impl, q, k, v, pos, kvl, d_out)
  return np.asarray(out), tuple(np.asarray(g) for g in grads)


def check_nan_propagates(impl, dtype, t, d, name):
  """The case ``name``: NaN in the affected outputs and gradients, the stock XLA control
  NaN there too, the bits of every row the corruption cannot reach unchanged, the row that
  sees no key exact zeros."""
  q, k, v, pos, kvl, d_out = batch(dtype, t, d)
  corrupt, nan_rows, nan_keys, same_rows = cases(t)[name]
  clean_out, clean_grads = run(impl, q, k, v, pos, kvl, d_out)
  assert np.all(np.isfinite(clean_out.astype(np.float32)))
  qb, kb = corrupt(q, k)
  out, grads = run(impl, qb, kb, v, pos, kvl, d_out)
  stock_out, stock_grads = run("xla", qb, kb, v, pos, kvl, d_out)
  f32 = lambda x: x.astype(np.float32)  # noqa: E731
  for i, h in nan_rows:
    assert np.all(np.isnan(f32(stock_out[0, i, h]))), f"control: stock output ({i}, {h})"
    assert np.all(np.isnan(f32(stock_grads[0][0, i, h]))), f"control: stock dq ({i}, {h})"
    assert np.all(np.isnan(f32(out[0, i, h]))), f"{impl}: output of query ({i}, {h})"
    assert np.all(np.isnan(f32(grads[0][0, i, h]))), f"{impl}: dq of query ({i}, {h})"
  for j in nan_keys:
    assert np.all(np.isnan(f32(grads[1][0, j]))), f"{impl}: dk of key {j}"
    assert np.all(np.isnan(f32(grads[2][0, j]))), f"{impl}: dv of key {j}"
  for i, h in same_rows:
    assert_bitwise_equal(out[0, i, h], clean_out[0, i, h], f"{impl}: output ({i}, {h})")
  # Rows 1 and 2 of the batch, outputs and every gradient: the bits of the clean call.
  assert_bitwise_equal(out[1:], clean_out[1:], f"{impl}: other batch rows")
  for gname, a, c in zip(("dq", "dk", "dv"), grads, clean_grads):
    assert_bitwise_equal(a[1:], c[1:], f"{impl}: {gname} of the other batch rows")
  check_unseen_rows_are_zero(out, grads, pos, kvl)


def check_unseen_rows_are_zero(out, grads, pos, kvl):
  """Queries that see no key: output +0 and dq +0; keys no query sees: dk = dv = +0."""
  zero = lambda x: np.all(np.asarray(x).astype(np.float32).view(np.uint32) == 0)  # noqa: E731
  pos, kvl = np.asarray(pos), np.asarray(kvl)
  for b in range(pos.shape[0]):
    for i in range(pos.shape[1]):
      if min(pos[b, i], kvl[b] - 1) < 0:
        assert zero(out[b, i]) and zero(grads[0][b, i]), f"query ({b}, {i}) sees no key"
    assert zero(grads[1][b, kvl[b]:]) and zero(grads[2][b, kvl[b]:]), f"keys of row {b}"


def check_unseen_content_is_inert(impl, dtype, t, d):
  """NaN in a padding query's q and d_out, in keys and values past ``kv_lengths`` and in the
  whole of a length-0 row: every output and gradient keeps the clean call's bits."""
  q, k, v, pos, kvl, d_out = batch(dtype, t, d)
  clean = run(impl, q, k, v, pos, kvl, d_out)
  q2 = q.at[1, 0].set(NAN).at[2].set(NAN)
  d2 = d_out.at[1, 0].set(NAN).at[2].set(NAN)
  k2 = k.at[1, t - 2:].set(NAN).at[2].set(INF)
  v2 = v.at[1, t - 2:].set(NAN).at[2].set(NAN)
  got = run(impl, q2, k2, v2, pos, kvl, d2)
  assert_bitwise_equal(got[0], clean[0], f"{impl}: output")
  for gname, a, c in zip(("dq", "dk", "dv"), got[1], clean[1]):
    assert_bitwise_equal(a[:2], c[:2], f"{impl}: {gname}")
  check_unseen_rows_are_zero(got[0], got[1], pos, kvl)


def check_default_positions_and_decode(impl, dtype, t, d):
  """Two more layouts: the default positions (the backward's ``every_row_sees_a_key``
  hint) with NaN in ``q`` at query ``(2, 0)`` of row 0, and a one-query decode step of
  every row (the Mosaic kernel's heads-major layout) with NaN in a key row 0's query sees:
  NaN there, the stock control NaN too, the other rows' bits unchanged."""
  q, k, v, pos, kvl, d_out = batch(dtype, t, d)
  f = jax.jit(lambda q, k, v: causal_attention(q, k, v, implementation=impl))
  stock = jax.jit(lambda q, k, v: causal_attention(q, k, v, implementation="xla"))
  g = jax.jit(jax.grad(lambda q, k, v: jnp.vdot(  # noqa: E731
      causal_attention(q, k, v, implementation=impl).astype(jnp.float32),
      d_out.astype(jnp.float32)), argnums=(0, 1, 2)))
  q_bad = q.at[0, 2, 0, 3].set(NAN)
  clean, bad = np.asarray(f(q, k, v)), np.asarray(f(q_bad, k, v))
  assert np.all(np.isnan(np.asarray(stock(q_bad, k, v))[0, 2, 0].astype(np.float32)))
  assert np.all(np.isnan(bad[0, 2, 0].astype(np.float32))), f"{impl}: default positions"
  assert_bitwise_equal(bad[0, 2, 1], clean[0, 2, 1], f"{impl}: the other head")
  assert_bitwise_equal(bad[1:], clean[1:], f"{impl}: the other batch rows")
  g_clean, g_bad = g(q, k, v), g(q_bad, k, v)
  assert np.all(np.isnan(np.asarray(g_bad[0][0, 2, 0]).astype(np.float32)))
  for a, c in zip(g_bad, g_clean):
    assert_bitwise_equal(np.asarray(a)[1:], np.asarray(c)[1:], f"{impl}: gradients")

  one = lambda x: x[:, -1:]  # noqa: E731
  k_bad = k.at[0, 1, 0, 5].set(NAN)
  step = jax.jit(lambda q, k, v, p, n: causal_attention(  # noqa: E731
      q, k, v, q_positions=p, kv_lengths=n, implementation=impl))
  clean = np.asarray(step(one(q), k, v, one(pos), kvl))
  bad = np.asarray(step(one(q), k_bad, v, one(pos), kvl))
  assert np.all(np.isnan(bad[0].astype(np.float32))), f"{impl}: decode step"
  assert_bitwise_equal(bad[1:], clean[1:], f"{impl}: decode, the other batch rows")
  assert np.all(np.asarray(bad[2]).astype(np.float32).view(np.uint32) == 0)
