"""causal_attention's Pallas Triton kernels on CPU (interpret mode): accuracy, NaN in
padding never reaching outputs or gradients, gradients, transformations, bad input.
Every invariance (decode = prefill, batch, position, padding, chunking, mode, run to run)
for every implementation: tests/test_contract.py. The "cpu" implementation:
tests/attention/test_attention_cpu.py."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err

from jaxrl_kernels import _backend
from jaxrl_kernels.attention import causal_attention
from jaxrl_kernels.attention.reference import attention_reference as reference

IMPL = "interpret"


def inputs(seed, b, t, s, hq, hkv, d, dtype, *, spread=10):
  """q, k, v revealing any reordering: v rows scaled by 2**e, e in [-spread, spread]."""
  k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(k1, (b, t, hq, d)) * 2.0 ** jax.random.uniform(k4, (b, t, hq, 1),
                                                                        minval=-1, maxval=1)
  k = jax.random.normal(k2, (b, s, hkv, d))
  v = jax.random.normal(k3, (b, s, hkv, d))
  v = v * 2.0 ** jax.random.randint(k5, (b, s, hkv, 1), -spread, spread + 1).astype(jnp.float32)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def default_pos(b, tq, s):
  return np.broadcast_to(s - tq + np.arange(tq), (b, tq)).astype(np.int32)


@pytest.mark.parametrize("dtype,d,hq,hkv", [
    (jnp.float32, 16, 4, 2), (jnp.float32, 32, 2, 2), (jnp.bfloat16, 32, 4, 1),
    (jnp.bfloat16, 16, 2, 2), (jnp.float16, 48, 2, 1),
])
def test_forward_matches_float64_reference(dtype, d, hq, hkv):
  b, t = 3, 70
  q, k, v = inputs(0, b, t, t, hq, hkv, d, dtype, spread=3)
  pos = np.stack([np.arange(t), np.arange(t), np.r_[-np.ones(10), np.arange(t - 10)]]).astype(
      np.int32)  # row 2: 10 padding queries, then a shifted sequence
  kvl = np.array([t, 41, t], np.int32)
  out = causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl, implementation=IMPL)
  assert out.dtype == dtype and out.shape == q.shape
  ref = reference(q, k, v, pos, kvl, 1 / np.sqrt(d))
  assert rel_err(out, ref) <= TOL[jnp.dtype(dtype).name][0]
  assert np.all(np.asarray(out[2, :10]) == 0)  # queries that see no key give exactly 0
  ref_xla = causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl, implementation="xla")
  assert rel_err(ref_xla, ref) <= TOL[jnp.dtype(dtype).name][0]


@pytest.mark.parametrize("dtype,hq,hkv", [(jnp.float32, 4, 2), (jnp.bfloat16, 2, 1)])
def test_gradients_match_float64_reference(dtype, hq, hkv):
  b, t, d = 2, 70, 16
  q, k, v = inputs(6, b, t, t, hq, hkv, d, dtype, spread=2)
  pos = np.stack([np.arange(t), np.r_[np.arange(t - 5), -np.ones(5)]]).astype(np.int32)
  kvl = np.array([t, 60], np.int32)
  d_out = jax.random.normal(jax.random.key(7), q.shape).astype(dtype)
  f = lambda q, k, v: causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl,  # noqa: E731
                                       scale=0.3, implementation=IMPL)
  _, vjp = jax.vjp(f, q, k, v)
  grads = vjp(d_out)
  _, ref = reference(q, k, v, pos, kvl, 0.3, d_out)
  tol = TOL[jnp.dtype(dtype).name][1]
  for name, g, r, x in zip("qkv", grads, ref, (q, k, v)):
    assert g.dtype == x.dtype and g.shape == x.shape
    assert rel_err(g, r) <= tol, name
  assert not np.any(np.asarray(grads[0][1, -5:], np.float32))  # padding queries: zero gradient
  assert not np.any(np.asarray(grads[1][1, 60:], np.float32))  # keys past kv_lengths
  assert not np.any(np.asarray(grads[2][1, 60:], np.float32))


def _triton_grads_checked(q, k, v, pos, kvl, d_out, cfg):
  """The interpreted Triton kernels' (dq, dk, dv) under backward config ``cfg`` (scale 0.3),
  checked against the float64 reference's gradients and for the same bits run to run."""
  from jaxrl_kernels.pallas import attention_triton as at

  @jax.jit
  def grads(q, k, v, d_out):
    out, lse = at.forward(q, k, v, pos, kvl, scale=0.3, interpret=True)
    return at.backward(q, k, v, pos, kvl, out, lse, d_out, scale=0.3, interpret=True,
                       config=cfg)

  got = grads(q, k, v, d_out)
  _, ref = reference(q, k, v, pos, kvl, 0.3, d_out)
  for name, g, r in zip("qkv", got, ref):
    assert rel_err(g, r) <= TOL["float32"][1], name
  for name, g, h in zip("qkv", got, grads(q, k, v, d_out)):
    assert_bitwise_equal(g, h, f"d{name} run to run")
  return got


@pytest.mark.parametrize("block_q,split_rows", [(32, 32), (32, 96), (64, 64), (64, 4096)])
def test_dkv_split_over_query_ranges(block_q, split_rows):
  """dK/dV with the (head, query block) walk cut into ranges of ``split_rows`` rows, one
  program each, float32 partials summed in range order: the float64 reference's gradients
  (every range count: 4096 = one range, the unsplit store), dq untouched, and the same bits
  run to run."""
  from jaxrl_kernels.pallas import attention_triton as at

  b, t, d, hq, hkv = 2, 70, 16, 4, 2
  q, k, v = inputs(11, b, t, t, hq, hkv, d, jnp.float32, spread=2)
  pos = np.stack([np.arange(t), np.r_[np.arange(t - 5), -np.ones(5)]]).astype(np.int32)
  kvl = np.array([t, 60], np.int32)
  d_out = jax.random.normal(jax.random.key(12), q.shape)
  cfg = at.BackwardConfig(dkv_block_q=block_q, dkv_split_rows=split_rows)
  got = _triton_grads_checked(q, k, v, pos, kvl, d_out, cfg)
  assert not np.any(np.asarray(got[1][1, 60:]))  # keys past kv_lengths: zero gradient


def test_dkv_walks_are_the_blocks_that_see_each_key_block():
  """dkv_walks: (lo, hi) spans exactly the query blocks whose rows see a key block (numpy
  brute force), so a causal row walks from the key block on and a document slot stops at
  its end; keys no row sees walk nothing."""
  from jaxrl_kernels.pallas import attention_triton as at

  t, s_len, bq, bk = 70, 80, 16, 16
  rng = np.random.default_rng(0)
  pos = np.stack([np.arange(t), np.r_[np.arange(20), -np.ones(t - 20)],
                  np.arange(t)[::-1], rng.permutation(np.r_[np.arange(t - 9), -np.ones(9)])])
  pos = pos.astype(np.int32)
  kvl = np.array([s_len, 20, 50, 0], np.int32)
  walks = np.asarray(at.dkv_walks(jnp.asarray(pos), jnp.asarray(kvl), tq=t, s_len=s_len,
                                  block_q=bq, block_k=bk))
  n_qb, n_kb = -(-t // bq), -(-s_len // bk)
  assert walks.shape == (4, n_kb, 2)
  for b in range(4):
    last = np.maximum(np.minimum(pos[b], kvl[b] - 1), -1)
    last = np.r_[last, -np.ones(n_qb * bq - t)].reshape(n_qb, bq).max(1)
    for kb in range(n_kb):
      seen = np.flatnonzero(last >= kb * bk)
      want = (seen[0], seen[-1] + 1) if seen.size else (0, 0)
      assert tuple(walks[b, kb]) == want, (b, kb)
  # the causal row walks from its key block on; the 20-token slot stops at its end
  assert [tuple(w) for w in walks[0]] == [(kb, n_qb) for kb in range(n_kb)]
  assert [tuple(w) for w in walks[1]] == [(0, 2), (1, 2)] + [(0, 0)] * (n_kb - 2)


@pytest.mark.parametrize("split_rows", [16, 48, 4096])
def test_dkv_walk_with_slots_shuffled_positions_and_split_ranges(split_rows):
  """dK/dV of rows whose walks are cut short (document slots, keys past kv_lengths) or
  hold blocks that see nothing inside [lo, hi) (decreasing and shuffled positions), with
  ranges of 16 rows (many partials, some key blocks using none), 48 and one range: the
  float64 reference's gradients, zero for unseen keys, the same bits run to run."""
  from jaxrl_kernels.pallas import attention_triton as at

  b, t, d, hq, hkv = 4, 70, 16, 6, 2
  q, k, v = inputs(21, b, t, t, hq, hkv, d, jnp.float32, spread=2)
  rng = np.random.default_rng(1)
  pos = np.stack([np.r_[np.arange(20), -np.ones(t - 20)], np.arange(t)[::-1],
                  rng.permutation(np.r_[np.arange(t - 9), -np.ones(9)]), np.arange(t)])
  pos = pos.astype(np.int32)
  kvl = np.array([t, 50, t, 33], np.int32)
  d_out = jax.random.normal(jax.random.key(22), q.shape)
  cfg = at.BackwardConfig(dkv_block_q=16, dkv_block_k=16, dkv_split_rows=split_rows)
  got = _triton_grads_checked(q, k, v, pos, kvl, d_out, cfg)
  assert not np.any(np.asarray(got[1][0, 20:]))  # keys no query of the slot sees
  assert not np.any(np.asarray(got[2][3, 33:]))  # keys past kv_lengths


def test_default_backward_tiles_follow_dtype_and_head_dim(monkeypatch):
  """Without a config the backward runs default_backward_config: a 64-key dQ step and 3
  stages for 16-bit inputs whose head dim pads to 64, 4096-row dK/dV ranges for 16-bit
  inputs at D = 128, the general default otherwise; those
  tiles' gradients are the float64 reference's."""
  from jaxrl_kernels.pallas import attention_triton as at

  tuned = at.BackwardConfig(dq_block_k=64, num_stages=3)
  for dtype, d, want in ((jnp.bfloat16, 64, tuned), (jnp.float16, 48, tuned),
                         (jnp.bfloat16, 128, at.BackwardConfig(dkv_split_rows=4096)),
                         (jnp.bfloat16, 112, at.BackwardConfig()),
                         (jnp.bfloat16, 32, at.BackwardConfig()),
                         (jnp.float32, 64, at.BackwardConfig())):
    assert at.default_backward_config(dtype, d) == want, (jnp.dtype(dtype).name, d)
  b, t, d, hq, hkv = 2, 70, 64, 4, 2
  pos = np.stack([np.arange(t), np.r_[np.arange(t - 5), -np.ones(5)]]).astype(np.int32)
  kvl = np.array([t, 60], np.int32)
  q, k, v = inputs(31, b, t, t, hq, hkv, d, jnp.float32, spread=2)
  _triton_grads_checked(q, k, v, pos, kvl, jax.random.normal(jax.random.key(32), q.shape),
                        tuned)
  seen = []
  real = at.backward_dq
  monkeypatch.setattr(at, "backward_dq", lambda *a, **kw: seen.append(kw["config"]) or
                      real(*a, **kw))
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  out, lse = at.forward(qb, kb, vb, pos, kvl, scale=0.125, interpret=True)
  at.backward(qb, kb, vb, pos, kvl, out, lse, out, scale=0.125, interpret=True)
  assert seen == [tuned]


@pytest.mark.parametrize("kw", [dict(dkv_split_rows=48), dict(dkv_split_rows=0),
                                dict(dkv_block_q=24), dict(dq_block_k=8)])
def test_backward_config_rejects_bad_tiles(kw):
  from jaxrl_kernels.pallas import attention_triton as at

  with pytest.raises(ValueError, match=next(iter(kw))):
    at.BackwardConfig(**kw)


def _same_rows_as(f, g, q, k, v):
  """``f`` and ``g`` (two layouts of one attention call) give the same output and dq bits;
  dk/dv (another summation order over the group's rows) agree to rounding."""
  assert_bitwise_equal(jax.jit(f)(q, k, v), jax.jit(g)(q, k, v), "output")
  w = jax.random.normal(jax.random.key(3), q.shape).astype(q.dtype)
  grad = lambda h: jax.jit(jax.grad(lambda *a: jnp.sum(h(*a).astype(jnp.float32) * w),
                                    argnums=(0, 1, 2)))(q, k, v)
  (dq_f, dk_f, dv_f), (dq_g, dk_g, dv_g) = grad(f), grad(g)
  assert_bitwise_equal(dq_f, dq_g, "dq")
  tol = TOL[jnp.dtype(q.dtype).name][0]
  for name, x, y in (("dk", dk_f, dk_g), ("dv", dv_f, dv_g)):
    assert rel_err(x, np.asarray(y, np.float64)) <= tol, name


@pytest.mark.parametrize("impl", ["interpret", "cpu"])
@pytest.mark.parametrize("dtype,hq,hkv,tq", [
    (jnp.float32, 4, 2, 70), (jnp.bfloat16, 6, 2, 70),
    pytest.param(jnp.bfloat16, 7, 1, 1, marks=pytest.mark.slow),
    pytest.param(jnp.float16, 6, 3, 5, marks=pytest.mark.slow),
])
def test_group_folding_keeps_the_bits(impl, dtype, hq, hkv, tq):
  """GQA: the query heads of a group run as rows of one head (api._grouped_as_rows). Every
  output row and dq row has the bits of the unfolded kernel call (a row's bits do not
  depend on its block slot or its block-mates); dk/dv (other summation order) agree to
  rounding. A decode step (tq = 1) included."""
  from jaxrl_kernels.attention import api

  b, s, d = 2, 70, 16
  q, k, v = inputs(9, b, tq, s, hq, hkv, d, dtype, spread=3)
  pos = np.stack([s - tq + np.arange(tq), np.r_[np.arange(tq - 1), -1]]).astype(np.int32)
  kvl = np.array([s, 41], np.int32)
  st = api._Static(1 / np.sqrt(d), impl)

  def folded(q, k, v):
    return causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl, implementation=impl)

  def unfolded(q, k, v):
    return api._attention(q, k, v, jnp.asarray(pos), jnp.asarray(kvl), st)

  _same_rows_as(folded, unfolded, q, k, v)


@pytest.mark.parametrize("impl", ["interpret", "cpu"])
def test_long_calls_pass_grouped_heads_unfolded(impl, monkeypatch):
  """From api.UNFOLDED_MIN_QUERIES queries on (lowered here to 64), grouped query heads
  reach the kernels unfolded: no transposed copy at the top level of the call (one below
  the threshold, the control), every output and dq row with the bits of the folded kernel
  call, dk/dv (summed head by head rather than in the folded order) equal to rounding."""
  from jaxrl_kernels.attention import api
  from jaxrl_kernels.pallas import attention_triton as at

  monkeypatch.setattr(api, "UNFOLDED_MIN_QUERIES", 64)
  b, s, hq, hkv, d, dtype = 2, 70, 6, 2, 16, jnp.bfloat16
  g = hq // hkv
  st = api._Static(1 / np.sqrt(d), impl)

  def top_level_ops(tq):
    q, k, v = inputs(1, b, tq, s, hq, hkv, d, dtype)
    jaxpr = jax.make_jaxpr(lambda q, k, v: causal_attention(q, k, v, implementation=impl))
    return {e.primitive.name for e in jaxpr(q, k, v).eqns}

  assert "transpose" in top_level_ops(63)  # control: the fold's copies
  assert "transpose" not in top_level_ops(64)

  tq = 70
  q, k, v = inputs(9, b, tq, s, hq, hkv, d, dtype, spread=3)
  pos = jnp.asarray(np.stack([np.arange(tq), np.r_[np.arange(tq - 1), -1]]), jnp.int32)
  kvl = jnp.array([s, 41], jnp.int32)

  def public(q, k, v):
    return causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl, implementation=impl)

  def folded(q, k, v):
    out = api._attention(at.fold_groups(q, g), k, v, jnp.repeat(pos, g, axis=1), kvl, st)
    return at.unfold_groups(out, g)

  _same_rows_as(public, folded, q, k, v)


def test_delta_rows_fixed_order():
  """rowsum(dO * O) in XLA is written-out adds in one fixed order (no XLA reduce or dot,
  whose order follows the shape: on an H100 the GQA-folded layout gave other bits):
  float64 accuracy, and the folded rows' bits equal the unfolded ones'."""
  from jaxrl_kernels.pallas import attention_triton as at

  o, do = (jax.random.normal(jax.random.key(i), (2, 70, 6, 64), jnp.bfloat16) for i in (0, 1))
  module = jax.jit(at.delta_rows).lower(o, do).as_text()
  assert "stablehlo.reduce" not in module and "dot_general" not in module
  got = at.delta_rows(o, do)
  want = np.einsum("bqhd,bqhd->bhq", np.asarray(do, np.float64), np.asarray(o, np.float64))
  assert got.shape == (2, 6, 70) and got.dtype == jnp.float32
  assert np.max(np.abs(np.asarray(got, np.float64) - want)) <= 1e-6 * np.max(np.abs(want))
  folded = at.delta_rows(at.fold_groups(o, 3), at.fold_groups(do, 3))
  # The same rows in the folded order: [B, Hkv, G, T] -> [B, Hkv, T * G].
  assert_bitwise_equal(folded, jnp.swapaxes(got.reshape(2, 2, 3, 70), 2, 3).reshape(2, 2, 210),
                       "folded delta")


def test_mosaic_backward_refuses_heads_off_the_groups():
  """The Mosaic backward takes grouped heads as they are; query heads that are not a
  multiple of the kv heads are refused by name (before any kernel), not read wrongly."""
  from jaxrl_kernels.pallas import attention_mosaic_bwd

  z = lambda *shape: jnp.zeros(shape, jnp.bfloat16)  # noqa: E731
  with pytest.raises(ValueError, match="query heads 3 are not a multiple of kv heads 2"):
    attention_mosaic_bwd.backward(z(1, 8, 3, 128), z(1, 8, 2, 128), z(1, 8, 2, 128),
                                  jnp.zeros((1, 8), jnp.int32), jnp.full((1,), 8, jnp.int32),
                                  z(1, 8, 3, 128), jnp.zeros((1, 3, 8)), z(1, 8, 3, 128),
                                  scale=1.0)


def test_jit_vmap_compose():
  q, k, v = inputs(8, 2, 20, 20, 2, 1, 16, jnp.float32)
  qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
  f = lambda q, k, v: causal_attention(q, k, v, implementation=IMPL)  # noqa: E731
  batched = jax.jit(jax.vmap(f))(qs, ks, vs)
  for i in range(2):
    assert_bitwise_equal(batched[i], f(qs[i], ks[i], vs[i]), f"vmap {i}")
  loss = lambda q, k, v: jnp.sum(jax.vmap(f)(q, k, v) ** 2)  # noqa: E731
  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qs, ks, vs)
  g0 = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
  for a, c in zip(g, g0):
    assert rel_err(a[0], c) <= 1e-6


def test_empty_and_defaults():
  q, k, v = inputs(9, 1, 3, 5, 2, 2, 16, jnp.float32)
  out = causal_attention(q, k, v, implementation=IMPL)
  ref = reference(q, k, v, default_pos(1, 3, 5), np.array([5]), 0.25)
  assert rel_err(out, ref) <= 1e-5
  assert causal_attention(q[:, :0], k, v, implementation=IMPL).shape == (1, 0, 2, 16)
  assert not np.any(np.asarray(causal_attention(q, k[:, :0], v[:, :0], implementation=IMPL)))


@pytest.mark.parametrize("kwargs,shapes,err,match", [
    ({}, ((2, 3, 4), (2, 3, 2, 16), (2, 3, 2, 16)), ValueError, "q must be"),
    ({}, ((2, 3, 4, 16), (2, 3, 3, 16), (2, 3, 3, 16)), ValueError, "multiple"),
    ({}, ((2, 3, 2, 16), (1, 3, 2, 16), (1, 3, 2, 16)), ValueError, "batch"),
    ({}, ((2, 3, 2, 16), (2, 3, 2, 32), (2, 3, 2, 32)), ValueError, "head dim"),
    ({}, ((2, 3, 2, 16), (2, 3, 2, 16), (2, 4, 2, 16)), ValueError, "same shape"),
    ({}, ((2, 3, 2, 24), (2, 3, 2, 24), (2, 3, 2, 24)), ValueError, "multiples of 16"),
    ({}, ((2, 3, 2, 512), (2, 3, 2, 512), (2, 3, 2, 512)), ValueError, "multiples of 16"),
    ({"q_positions": np.zeros((2, 4), np.int32)}, None, ValueError, "q_positions"),
    ({"q_positions": np.zeros((2, 3), np.float32)}, None, TypeError, "q_positions"),
    ({"kv_lengths": np.zeros((3,), np.int32)}, None, ValueError, "kv_lengths"),
    ({"scale": float("nan")}, None, ValueError, "scale"),
    ({"implementation": "cuda"}, None, ValueError, "not available"),
])
def test_bad_inputs(kwargs, shapes, err, match):
  shapes = shapes or ((2, 3, 2, 16), (2, 3, 2, 16), (2, 3, 2, 16))
  q, k, v = (jnp.zeros(s, jnp.float32) for s in shapes)
  kwargs = {"implementation": IMPL, **kwargs}
  with pytest.raises(err, match=match):
    causal_attention(q, k, v, **kwargs)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU error path")
@pytest.mark.parametrize("impl", ["mosaic", "triton"])
def test_gpu_implementations_are_unavailable_on_cpu(impl):
  q = jnp.zeros((1, 2, 2, 16), jnp.bfloat16)
  with pytest.raises(_backend.ImplementationUnavailableError,
                     match="needs a CUDA GPU.*implementation='cpu'"):
    causal_attention(q, q, q, implementation=impl)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU default")
def test_default_on_cpu_is_cpu_not_interpret():
  """The CPU default is implementation="cpu" (tests/attention/test_attention_cpu.py);
  the interpreter runs only when asked for."""
  q, k, v = inputs(10, 1, 9, 9, 2, 1, 16, jnp.float32)
  assert_bitwise_equal(causal_attention(q, k, v), causal_attention(q, k, v, implementation="cpu"),
                       "default")


@pytest.mark.parametrize("implementation", ["interpret", "cpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nan_in_padding_reaches_no_output_and_no_gradient(dtype, implementation):
  """NaN and inf in padding queries (position -1: q and their cotangent), in keys and
  values past kv_lengths, and in whole padding rows of the batch: the real rows'
  outputs and every gradient keep the bits of clean padding (CONTRACT.md section 3)."""
  b, t, s, hq, hkv, d = 2, 70, 100, 2, 1, 16
  q, k, v = inputs(11, b, t, s, hq, hkv, d, dtype, spread=2)
  n_pad = 6  # padding queries at the end of each row
  pos = np.concatenate([np.broadcast_to(np.arange(t - n_pad), (b, t - n_pad)),
                        -np.ones((b, n_pad))], 1).astype(np.int32)
  kvl = np.array([t - n_pad, 50], np.int32)
  d_out = jax.random.normal(jax.random.key(12), q.shape).astype(dtype)
  key_pad = jnp.arange(s)[None, :, None, None] >= kvl[:, None, None, None]
  q_pad = jnp.asarray(pos < 0)[:, :, None, None]

  @jax.jit
  def run(q, k, v, d_out):
    f = lambda q, k, v: causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl,  # noqa: E731
                                         implementation=implementation)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(d_out)

  clean = run(jnp.where(q_pad, 0, q), jnp.where(key_pad, 0, k), jnp.where(key_pad, 0, v),
              jnp.where(q_pad, 0, d_out))
  dirty = run(jnp.where(q_pad, jnp.nan, q), jnp.where(key_pad, jnp.inf, k),
              jnp.where(key_pad, jnp.nan, v), jnp.where(q_pad, jnp.nan, d_out))
  out, grads = dirty
  assert not np.any(bits(out[:, t - n_pad:])), "padding queries output +0"
  assert_bitwise_equal(out, clean[0], "outputs")
  for name, g, c in zip("qkv", grads, clean[1]):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    assert_bitwise_equal(g, c, f"d{name}")


def test_bad_dtypes():
  q = jnp.zeros((1, 2, 2, 16), jnp.bfloat16)
  with pytest.raises(TypeError, match="one dtype"):
    causal_attention(q, q.astype(jnp.float32), q, implementation=IMPL)
  with pytest.raises(TypeError, match="must be one of"):
    causal_attention(q.astype(jnp.int32), q, q, implementation=IMPL)


@pytest.mark.parametrize("b,tq,s_len,d", [(2, 1000, 1000, 64), (64, 1, 4096, 64),
                                          (1, 300, 77, 128)])
def test_mosaic_forward_kernel_lowers_for_cuda(b, tq, s_len, d):
  """The Mosaic forward (prefill and decode shapes) lowers to a CUDA module on any machine,
  on every jax the package supports; its bits are tested on a Hopper GPU."""
  from jaxrl_kernels.pallas import attention_mosaic
  bf16, i32 = jnp.bfloat16, jnp.int32
  sd = jax.ShapeDtypeStruct
  args = (sd((b, tq, 14, d), bf16), sd((b, s_len, 2, d), bf16), sd((b, s_len, 2, d), bf16),
          sd((b, tq), i32), sd((b,), i32))
  fn = jax.jit(functools.partial(attention_mosaic.forward, scale=d ** -0.5))
  exported = jax.export.export(fn, platforms=["cuda"])(*args)
  assert [a.shape for a in exported.out_avals] == [(b, tq, 14, d), (b, 14, tq)]
  assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("b,rows,d,lanes", [(64, 4, 64, None), (17, 4, 64, 2), (3, 7, 128, 1),
                                           (2, 12, 64, 1), (2, 130, 128, 1), (2, 200, 64, 1)])
def test_mosaic_heads_major_forward_lowers_for_cuda(b, rows, d, lanes):
  """The heads-major layout (``q [B, H, R, D]``: a decode step's, and R up to two CTA
  blocks, an odd batch over two lanes) lowers to a CUDA module on any machine, with the
  output in q's layout and the logsumexp in its own; bits: test_attention_mosaic_gpu.py."""
  from jaxrl_kernels.pallas import attention_mosaic
  bf16, i32 = jnp.bfloat16, jnp.int32
  sd = jax.ShapeDtypeStruct
  args = (sd((b, 2, rows, d), bf16), sd((b, 1536, 2, d), bf16), sd((b, 1536, 2, d), bf16),
          sd((b, rows), i32), sd((b,), i32))
  fn = jax.jit(functools.partial(attention_mosaic.forward, scale=d ** -0.5, lanes=lanes,
                                 heads_major=True))
  exported = jax.export.export(fn, platforms=["cuda"])(*args)
  assert [a.shape for a in exported.out_avals] == [(b, 2, rows, d), (b, 2, rows)]
  assert "mosaic_gpu" in exported.mlir_module()


def test_mosaic_decode_step_copies_no_query():
  """``causal_attention``'s decode step on the Mosaic kernel (Llama-3.2-1B's heads, 64
  rows) lowers with no bf16 pad or transpose around the kernel: the query heads reach it
  as a reshape (heads-major), its output leaves as one. The control: a two-query call
  (row-major) has both."""
  from jaxrl_kernels.attention import api
  bf16, i32 = jnp.bfloat16, jnp.int32
  sd = jax.ShapeDtypeStruct

  def module(tq):
    args = (sd((64, tq, 32, 64), bf16), sd((64, 1536, 8, 64), bf16),
            sd((64, 1536, 8, 64), bf16), sd((64, tq), i32), sd((64,), i32))
    fn = jax.jit(lambda q, k, v, p, n: api._grouped_as_rows(q, k, v, p, n,
                                                             api._Static(0.125, "mosaic")))
    return jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()

  copies = re.compile(r"stablehlo\.(pad|transpose)[^\n]*bf16")
  decode, control = module(1), module(2)
  assert "mosaic_gpu" in decode
  assert not copies.search(decode), copies.search(decode).group(0)
  assert copies.search(control)


@pytest.mark.parametrize("b,tq,d,stages,heads_major", [(64, 4, 64, 3, True), (2, 4, 64, 1, True),
                                                      (2, 4, 128, 3, True),
                                                      (1, 300, 64, 3, False)])
def test_mosaic_ring_depths_lower_for_cuda(b, tq, d, stages, heads_major):
  """The K/V ring's depth (``stages``, a free knob) lowers for CUDA at a decode step over
  two lanes (three stages: two rings of three 8 KiB K and V tiles each), with one stage, at
  D = 128 with three, and at a D = 64 prefill block with three; bits:
  test_attention_mosaic_gpu.py."""
  from jaxrl_kernels.pallas import attention_mosaic
  bf16, i32 = jnp.bfloat16, jnp.int32
  sd = jax.ShapeDtypeStruct
  qs = (b, 8, tq, d) if heads_major else (b, tq, 8, d)
  args = (sd(qs, bf16), sd((b, 1536, 2, d), bf16), sd((b, 1536, 2, d), bf16),
          sd((b, tq), i32), sd((b,), i32))
  fn = jax.jit(functools.partial(attention_mosaic.forward, scale=d ** -0.5, stages=stages,
                                 heads_major=heads_major))
  exported = jax.export.export(fn, platforms=["cuda"])(*args)
  assert [a.shape for a in exported.out_avals] == [qs, (b, 8, tq)]
  assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("b,tq,d,lanes,stages", [(161, 4, 64, 2, 2), (150, 1, 128, 1, 1),
                                                  (3, 8, 64, 1, 3)])
def test_mosaic_persistent_decode_lowers_for_cuda(b, tq, d, lanes, stages):
  """Persistent decode CTAs (``forward(persistent=True)``: one CTA per SM walking the (batch
  group, head) items) lower for CUDA with one and two lanes and 1-3 stages; a prefill block
  (more than 64 rows after the GQA fold) is refused by name. Bits:
  test_attention_mosaic_gpu.py::test_persistent_ctas_keep_the_bits."""
  from jaxrl_kernels.pallas import attention_mosaic
  bf16, i32 = jnp.bfloat16, jnp.int32
  sd = jax.ShapeDtypeStruct
  args = (sd((b, 8, tq, d), bf16), sd((b, 1000, 2, d), bf16), sd((b, 1000, 2, d), bf16),
          sd((b, tq), i32), sd((b,), i32))
  fn = jax.jit(functools.partial(attention_mosaic.forward, scale=d ** -0.5, heads_major=True,
                                 lanes=lanes, stages=stages, persistent=True))
  exported = jax.export.export(fn, platforms=["cuda"])(*args)
  assert [a.shape for a in exported.out_avals] == [(b, 8, tq, d), (b, 8, tq)]
  assert "mosaic_gpu" in exported.mlir_module()
  q = jnp.zeros((1, 300, 4, 64), bf16)
  k = jnp.zeros((1, 512, 4, 64), bf16)
  with pytest.raises(ValueError, match="persistent CTAs take decode steps"):
    attention_mosaic.forward(q, k, k, jnp.zeros((1, 300), i32), jnp.ones((1,), i32),
                             scale=1.0, persistent=True)


def test_mosaic_persistent_default_rule():
  """Persistent decode CTAs are the default exactly for decode steps of one to four waves of
  (batch group, head) items (the rollout shapes where they were measured faster), the
  default module is the persistent one there, and a non-bool ``persistent`` is refused by
  name."""
  from jaxrl_kernels.pallas import attention_mosaic as am
  sms = _backend.DEFAULT_NUM_SMS
  assert not am.persistent_for(7, sms)  # one wave: nothing to walk
  assert am.persistent_for(7, sms + 1) and am.persistent_for(64, 4 * sms)
  assert not am.persistent_for(7, 4 * sms + 1)  # past four waves: no measured gain
  assert not am.persistent_for(65, 2 * sms)  # a prefill block
  bf16, i32 = jnp.bfloat16, jnp.int32
  sd = jax.ShapeDtypeStruct
  b = 64  # Llama-3.2-1B's decode step at 64 prompts: 8 kv heads x 32 lane pairs = 256 items
  args = (sd((b, 8, 4, 64), bf16), sd((b, 512, 8, 64), bf16), sd((b, 512, 8, 64), bf16),
          sd((b, 4), i32), sd((b,), i32))

  def text(**kw):
    fn = jax.jit(functools.partial(am.forward, scale=0.125, heads_major=True, **kw))
    return jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()

  saved = jax.config.jax_traceback_in_locations_limit
  try:  # source locations differ by the call's line: leave them out of the modules compared
    jax.config.update("jax_traceback_in_locations_limit", 0)
    assert text() == text(persistent=True) != text(persistent=False)
  finally:
    jax.config.update("jax_traceback_in_locations_limit", saved)
  q = jnp.zeros((1, 4, 4, 64), bf16)
  k = jnp.zeros((1, 512, 4, 64), bf16)
  with pytest.raises(ValueError, match="persistent must be a bool or None"):
    am.forward(q, k, k, jnp.zeros((1, 4), i32), jnp.ones((1,), i32), scale=1.0, persistent=1)


def test_mosaic_ring_depth_is_checked():
  """``stages`` must be an int >= 1 whose rings fit in shared memory, and at least 2 where
  two warpgroups share a ring: refused by name before any kernel is built. The default fits
  every supported shape."""
  from jaxrl_kernels.pallas import attention_mosaic as am
  q = jnp.zeros((2, 1, 4, 128), jnp.bfloat16)
  k = jnp.zeros((2, 256, 4, 128), jnp.bfloat16)
  pos, kvl = jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32)
  for bad in (0, -1, True, 2.0):
    with pytest.raises(ValueError, match="stages must be an int >= 1"):
      am.forward(q, k, k, pos, kvl, scale=1.0, stages=bad)
  with pytest.raises(ValueError, match="stages = 5 needs .* bytes of shared memory"):
    am.forward(q, k, k, pos, kvl, scale=1.0, stages=5)
  # A D = 128 prefill block with three stages: 233608 bytes by Mosaic's count, over 227 KiB.
  q2 = jnp.zeros((1, 300, 4, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="stages = 3 needs 233608 bytes"):
    am.forward(q2, k[:1], k[:1], jnp.zeros((1, 300), jnp.int32), kvl[:1], scale=1.0, stages=3)
  # One stage under two warpgroups sharing a ring deadlocks (it hung on an H100): refused.
  with pytest.raises(ValueError, match="at least 2 when two warpgroups share one K/V ring"):
    am.forward(q2, k[:1], k[:1], jnp.zeros((1, 300), jnp.int32), kvl[:1], scale=1.0, stages=1)
  for d in am.HEAD_DIMS:
    for wgs, lanes in ((2, 1), (1, 1)) + (((2, 2),) if d <= am.LANES_MAX_D else ()):
      assert am.smem_bytes(d, 2, wgs=wgs, lanes=lanes, stages=am.STAGES) <= am.SMEM_BYTES


def test_mosaic_lanes_need_one_block_and_d64():
  """Two lanes hold two K/V rings: refused at D = 128 and for more than one block's rows,
  by name, before any kernel is built."""
  from jaxrl_kernels.pallas import attention_mosaic
  q = jnp.zeros((2, 1, 4, 128), jnp.bfloat16)
  k = jnp.zeros((2, 256, 4, 128), jnp.bfloat16)
  pos, kvl = jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32)
  with pytest.raises(ValueError, match="lanes must be .* D <= 64"):
    attention_mosaic.forward(q, k, k, pos, kvl, scale=1.0, lanes=2)
  with pytest.raises(ValueError, match="lanes must be"):
    attention_mosaic.forward(q[..., :64], k[..., :64], k[..., :64], pos, kvl, scale=1.0,
                             lanes=3)


def test_triton_kernels_check_operand_shapes():
  """The Triton forward and backward refuse by name an operand of another shape than q's
  and k's imply (they index rows by those shapes) and query heads off the kv groups; the
  same calls with every shape right run (interpret mode)."""
  from jaxrl_kernels.pallas import attention_triton as at

  b, t, hq, hkv, d = 2, 9, 4, 2, 16
  q, k, v = inputs(31, b, t, t, hq, hkv, d, jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  kvl = jnp.full((b,), t, jnp.int32)
  out, lse = at.forward(q, k, v, pos, kvl, scale=0.25, interpret=True)
  args = dict(q=q, k=k, v=v, q_positions=pos, kv_lengths=kvl, out=out, lse=lse, d_out=out)
  calls = {
      "forward": lambda a: at.forward(a["q"], a["k"], a["v"], a["q_positions"],
                                      a["kv_lengths"], scale=0.25, interpret=True),
      "backward_dq": lambda a: at.backward_dq(*(a[n] for n in (
          "q", "k", "v", "q_positions", "kv_lengths", "out", "d_out", "lse")), scale=0.25,
          interpret=True),
      "backward": lambda a: at.backward(*(a[n] for n in (
          "q", "k", "v", "q_positions", "kv_lengths", "out", "lse", "d_out")), scale=0.25,
          interpret=True),
  }
  bad = {"v": v[:, :-1], "q_positions": pos[:1], "kv_lengths": kvl[:1], "out": out[:, :-1],
         "lse": lse[:, :hkv], "d_out": out[..., :-1]}
  for fn, call in calls.items():
    call(args)
    for name, value in bad.items():
      if fn == "forward" and name in ("out", "lse", "d_out"):
        continue
      with pytest.raises(ValueError, match=f"{fn}.*{name} has shape"):
        call({**args, name: value})
    with pytest.raises(ValueError, match="query heads 3 are not a multiple of kv heads 2"):
      call({**args, "q": q[:, :, :3], "out": out[:, :, :3], "d_out": out[:, :, :3],
            "lse": lse[:, :3]})


def test_mosaic_backward_checks_operand_shapes():
  """The Mosaic dQ and dK/dV kernels index their operands by the shapes of q and k: an
  operand of another shape is refused by name before any kernel (it would read other rows,
  not fail). The same call with every shape right gets past the checks (to the lowering,
  which needs a GPU here only to run)."""
  from jaxrl_kernels.pallas import attention_mosaic_bwd as mb

  b, t, hq, hkv, d = 2, 40, 6, 2, 128
  z = lambda *shape, dtype=jnp.bfloat16: jnp.zeros(shape, dtype)  # noqa: E731
  ok = dict(q=z(b, t, hq, d), k=z(b, 50, hkv, d), v=z(b, 50, hkv, d),
            q_positions=z(b, t, dtype=jnp.int32), kv_lengths=z(b, dtype=jnp.int32),
            d_out=z(b, t, hq, d), lse=z(b, hq, t, dtype=jnp.float32))
  dq_ok = {**ok, "out": z(b, t, hq, d)}
  dkv_ok = {**ok, "delta": z(b, hq, t, dtype=jnp.float32)}

  def call(fn, args):
    names = ("q", "k", "v", "q_positions", "kv_lengths", "d_out", "lse",
             "out" if fn is mb.dq else "delta")
    return fn(*(args[n] for n in names), scale=1.0)

  bad = {"k": z(b, 50, hkv, 64), "v": z(b, 49, hkv, d), "q_positions": z(b, t - 1, dtype=jnp.int32),
         "kv_lengths": z(b + 1, dtype=jnp.int32), "d_out": z(b, t, hq - 1, d),
         "lse": z(b, hkv, t, dtype=jnp.float32), "out": z(b, t + 1, hq, d),
         "delta": z(b, hq, t + 1, dtype=jnp.float32)}
  for fn, good in ((mb.dq, dq_ok), (mb.dkv, dkv_ok)):
    for name, value in bad.items():
      if name not in good:
        continue
      with pytest.raises(ValueError, match=f"{name} has shape"):
        call(fn, {**good, name: value})
  for fn, good in ((mb.dq, dq_ok), (mb.dkv, dkv_ok)):
    args = [jax.ShapeDtypeStruct(good[n].shape, good[n].dtype) for n in
            ("q", "k", "v", "q_positions", "kv_lengths", "d_out", "lse",
             "out" if fn is mb.dq else "delta")]
    triton_call = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    jax.export.export(jax.jit(functools.partial(fn, scale=1.0)), platforms=["cuda"],
                      disabled_checks=[triton_call])(*args)


@pytest.mark.parametrize("b,tq,s_len,d,hq", [(2, 1000, 1000, 64, 2), (1, 300, 77, 128, 2),
                                            (1, 700, 700, 128, 6)])
def test_mosaic_backward_kernels_lower_for_cuda(b, tq, s_len, d, hq):
  """The Mosaic dK/dV and dQ kernels lower to a CUDA module on any machine (Mosaic builds
  its TMA descriptors and register layouts while lowering, so a layout it rejects fails
  here), grouped heads (hq > 2 kv heads) as they are; dK/dV with several ranges of query
  rows (partials summed by a Triton kernel) and with one (the kernel stores them); their
  gradients are tested on a Hopper GPU (test_attention_mosaic_gpu.py)."""
  from jaxrl_kernels.pallas import attention_mosaic_bwd
  bf16, i32, f32 = jnp.bfloat16, jnp.int32, jnp.float32
  sd = jax.ShapeDtypeStruct
  kv = sd((b, s_len, 2, d), bf16)
  rows = sd((b, tq, hq, d), bf16)
  args = (rows, kv, kv, sd((b, tq), i32), sd((b,), i32), rows, sd((b, hq, tq), f32))
  triton_call = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  for split, summed in ((256, True), (8192, False)):
    fn = jax.jit(functools.partial(attention_mosaic_bwd.dkv, scale=d ** -0.5, split_rows=split))
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[triton_call])(
        *args, sd((b, hq, tq), f32))
    assert [a.shape for a in exported.out_avals] == [(b, s_len, 2, d)] * 2
    assert "mosaic_gpu" in exported.mlir_module()
    assert ("causal_attention_dkv_sum" in exported.mlir_module()) == summed, split
  fn = jax.jit(functools.partial(attention_mosaic_bwd.dq, scale=d ** -0.5))
  exported = jax.export.export(fn, platforms=["cuda"])(*args, rows)
  assert [a.shape for a in exported.out_avals] == [(b, tq, hq, d), (b, hq, tq)]
  assert "mosaic_gpu" in exported.mlir_module()
  three = sd((b, tq, 3, d), bf16)
  with pytest.raises(ValueError, match="query heads 3 are not a multiple of kv heads 2"):
    attention_mosaic_bwd.dkv(*(jnp.zeros(a.shape, a.dtype) for a in
                               (three, *args[1:5], three, sd((b, 3, tq), f32),
                                sd((b, 3, tq), f32))), scale=1.0)


@pytest.mark.parametrize("flag", [True, False])
def test_mosaic_dkv_without_padding_rows_lowers_without_the_clearing_pass(flag):
  """``dkv(every_row_sees_a_key=True)`` hands q and d_out to the kernel as they are: its
  CUDA module has no bf16 select of their shape. The control (False, the general call)
  has the select that zeroes padding rows. Bits (the same either way): the GPU test
  test_attention_mosaic_gpu.py::test_default_positions_keep_the_gradient_bits."""
  from jaxrl_kernels.pallas import attention_mosaic_bwd
  b, tq, hq, d = 1, 256, 4, 128
  bf16, i32, f32 = jnp.bfloat16, jnp.int32, jnp.float32
  sd = jax.ShapeDtypeStruct
  rows, kv, stats = sd((b, tq, hq, d), bf16), sd((b, tq, 2, d), bf16), sd((b, hq, tq), f32)
  fn = jax.jit(functools.partial(attention_mosaic_bwd.dkv, scale=d ** -0.5,
                                 every_row_sees_a_key=flag))
  text = jax.export.export(fn, platforms=["cuda"])(
      rows, kv, kv, sd((b, tq), i32), sd((b,), i32), rows, stats, stats).mlir_module()
  assert "mosaic_gpu" in text
  select = re.compile(rf"stablehlo\.select[^\n]*tensor<{b}x{tq}x{hq}x{d}xbf16>")
  assert bool(select.search(text)) != flag


def test_default_positions_tell_the_backward_no_row_is_padding(monkeypatch):
  """``causal_attention`` promises the backward ``every_row_sees_a_key`` exactly where no
  row can be padding: default positions and lengths with Tq <= S. Explicit positions or
  lengths (even the default values), or more queries than keys, keep the general pass.
  The hint reaches the backend's backward; the gradients are those of the explicit call."""
  from jaxrl_kernels.attention import api
  from jaxrl_kernels.attention.base import AttentionBackend

  jax.clear_caches()  # _backward is a jit: a trace cached by another test would skip the spy
  seen, promised = [], []
  cpu = api.BACKENDS["cpu"]
  grouped = api._grouped_as_rows

  def spy(*args):
    promised.append(args[-1].every_row_sees_a_key)
    return grouped(*args)
  monkeypatch.setattr(api, "_grouped_as_rows", spy)

  def backward(*args, every_row_sees_a_key, **kw):
    seen.append(every_row_sees_a_key)
    return cpu.backward(*args, every_row_sees_a_key=every_row_sees_a_key, **kw)
  monkeypatch.setitem(api.BACKENDS, "cpu", AttentionBackend(
      "cpu", forward=cpu.forward, backward=backward, supported=cpu.supported))

  b, t, s, d = 2, 9, 9, 16
  q, k, v = inputs(5, b, t, s, 4, 2, d, jnp.float32)

  def grads(q, k, v, **kw):
    f = lambda q, k, v: jnp.sum(jnp.sin(causal_attention(q, k, v, implementation="cpu", **kw)))  # noqa: E731
    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

  default = grads(q, k, v)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  explicit = grads(q, k, v, q_positions=pos)
  grads(q, k, v, kv_lengths=jnp.full((b,), s, jnp.int32))
  grads(q[:, :4], k[:, :3], v[:, :3])  # Tq > S: the first query has position -1
  assert promised == [True, False, False, False]
  # The backward's own traces: the kv_lengths call reuses the explicit call's.
  assert seen == [True, False, False]
  for name, a, c in zip("qkv", default, explicit, strict=True):
    assert_bitwise_equal(a, c, f"d{name}")
