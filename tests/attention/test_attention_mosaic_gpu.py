"""causal_attention's Mosaic kernel (Hopper, TMA + wgmma): what only this backend has to
prove.

Forward accuracy against float64 at shapes that are not multiples of its tiles, its
logsumexp residual driving the Mosaic backward (gradients within tolerance), the backward
kernels' walks (range splits, restarting positions, NaN in padding rows and in keys past
kv_lengths, run to run), and its place in the dispatch table (the Hopper default for
bf16/fp16 at head dims 64 and 128, Triton otherwise, clear errors). Every invariance
(decode = prefill up to T = 4096, padding, packing and NaN garbage, batch, chunking, mode,
run to run) is tests/test_contract.py.

  python -m pytest -q -m gpu tests/attention/test_attention_mosaic_gpu.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import nonfinite_cases as nonfinite
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, rel_err
from helpers import attention_inputs as inputs

from jaxrl_kernels.attention import causal_attention
from jaxrl_kernels.attention.reference import attention_reference as reference64
from jaxrl_kernels.pallas import attention_mosaic, attention_mosaic_bwd, attention_triton

pytestmark = pytest.mark.hopper
IMPL = "mosaic"
HQ, D = 4, 128


def arange_pos(b, t):
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def attn(q, k, v, pos=None, kvl=None, impl=IMPL):
  return causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl, implementation=impl)


@pytest.mark.parametrize("dtype,d,hkv,t", [
    (jnp.bfloat16, 128, HQ, 1000), (jnp.bfloat16, 64, 2, 777), (jnp.float16, 128, 1, 300),
    (jnp.float16, 64, HQ, 1024)])
def test_forward_accuracy(dtype, d, hkv, t):
  q, k, v = inputs(0, 2, t, HQ, hkv, d, dtype, spread=2)
  pos = arange_pos(2, t)
  kvl = jnp.array([t, t - 123], jnp.int32)
  out = attn(q, k, v, pos, kvl)
  ref = reference64(q, k, v, pos, kvl, d ** -0.5)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert rel_err(out, ref) <= TOL[jnp.dtype(dtype).name][0]


def test_decode_lanes_keep_the_bits():
  """Two batch entries per CTA, each on its own compute warpgroup and K/V ring (the
  decode rule for more CTAs than SMs), give a one-entry CTA's bits: an odd batch (a lane
  past it), positions from 0 to the end of the cache, NaN past kv_lengths; and float64
  accuracy. The rule picks two lanes only for decode-sized calls at D = 64."""
  b, s, hq, hkv, d = 5, 700, 8, 2, 64
  ks = jax.random.split(jax.random.key(11), 4)
  q = jax.random.normal(ks[0], (b, 1, hq, d)).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, hkv, d)).astype(jnp.bfloat16)
  v = (jax.random.normal(ks[2], (b, s, hkv, d))
       * 2.0 ** jax.random.randint(ks[3], (b, s, hkv, 1), -2, 3)).astype(jnp.bfloat16)
  pos = jnp.array([[699], [0], [350], [127], [257]], jnp.int32)
  kvl = jnp.array([700, 1, 351, 200, 258], jnp.int32)
  ref = reference64(q, k, v, pos, kvl, d ** -0.5)
  past = jnp.arange(s)[None, :, None, None] >= kvl[:, None, None, None]
  k, v = jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v)
  one = attention_mosaic.forward(q, k, v, pos, kvl, scale=d ** -0.5, lanes=1)
  two = attention_mosaic.forward(q, k, v, pos, kvl, scale=d ** -0.5, lanes=2)
  for name, x, y in zip(("out", "lse"), one, two):
    assert np.all(np.isfinite(np.asarray(y, np.float32))), name
    assert_bitwise_equal(y, x, f"{name}: two lanes vs one")
  assert rel_err(two[0], ref) <= TOL["bfloat16"][0]
  assert attention_mosaic.lanes_for(1, 64, 8, 64) == 2
  assert attention_mosaic.lanes_for(4, 64, 2, 64) == 1  # 128 CTAs: one wave
  assert attention_mosaic.lanes_for(1, 256, 2, 128) == 1  # two D = 128 rings do not fit
  assert attention_mosaic.lanes_for(128, 64, 8, 64) == 1  # a prefill block
  with pytest.raises(ValueError, match="lanes must be"):
    attention_mosaic.forward(q.repeat(100, axis=1), k, v, pos.repeat(100, axis=1), kvl,
                             scale=d ** -0.5, lanes=2)


@pytest.mark.parametrize("tq,d,stages", [(1, 64, 1), (1, 64, 3), (1, 128, 3), (300, 64, 3)])
def test_ring_depth_keeps_the_bits(tq, d, stages):
  """The K/V ring's depth (``stages``) changes how many tiles are loaded ahead, not which
  tiles or their order: out and lse are the default depth's bits, for decode steps (two
  lanes at D = 64, an odd batch) and prefill blocks, with NaN past kv_lengths."""
  b, s, hq, hkv = 5, 700, 8, 2
  ks = jax.random.split(jax.random.key(tq + d + stages), 4)
  q = jax.random.normal(ks[0], (b, tq, hq, d)).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, hkv, d)).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, hkv, d)).astype(jnp.bfloat16)
  pos = jnp.minimum(jax.random.randint(ks[3], (b, 1), 0, s - tq + 1) + jnp.arange(tq),
                    s - 1).astype(jnp.int32)
  kvl = jnp.array([700, 1, 351, 200, 699], jnp.int32)
  past = jnp.arange(s)[None, :, None, None] >= kvl[:, None, None, None]
  k, v = jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v)
  lanes = 2 if tq == 1 and d <= attention_mosaic.LANES_MAX_D else None
  base = attention_mosaic.forward(q, k, v, pos, kvl, scale=d ** -0.5, lanes=lanes)
  got = attention_mosaic.forward(q, k, v, pos, kvl, scale=d ** -0.5, lanes=lanes,
                                 stages=stages)
  for name, x, y in zip(("out", "lse"), base, got):
    assert np.all(np.isfinite(np.asarray(y, np.float32))), name
    assert_bitwise_equal(y, x, f"{name}: {stages} stages vs {attention_mosaic.STAGES}")


@pytest.mark.parametrize("b,d,lanes,stages,heads_major", [
    (161, 64, 2, 2, True), (171, 64, 2, 1, True), (171, 64, 2, 3, True), (161, 64, 1, 3, True),
    (150, 128, 1, 1, True), (150, 64, 1, 2, False), (21, 64, 2, 1, True)])
def test_persistent_ctas_keep_the_bits(b, d, lanes, stages, heads_major):
  """Persistent decode CTAs (one per SM, each walking (batch group, head) items with its K/V
  ring continuing across items) give the one-CTA-per-item kernel's out and lse bits, in two
  calls: more items than SMs (several items per CTA: one and two lanes, 1-3 stages, an idle
  lane past an odd batch on a later item) and fewer (batch 21 over two lanes: 88 items), both
  query layouts, an entry with no key (kv_length 0), a full cache, and NaN past kv_lengths.
  A synchronisation defect shows as a hang (run with --timeout) or as other bits."""
  s, hq, hkv, rows = 1000, 8, 2, 4
  ks = jax.random.split(jax.random.key(b + d + stages), 4)
  qs = (b, hq, rows, d) if heads_major else (b, rows, hq, d)
  q = jax.random.normal(ks[0], qs).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, hkv, d)).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, hkv, d)).astype(jnp.bfloat16)
  kvl = jax.random.randint(ks[3], (b,), 0, s + 1).astype(jnp.int32).at[1].set(0).at[2].set(s)
  pos = jnp.maximum(kvl[:, None] - rows + jnp.arange(rows), -1).astype(jnp.int32)
  past = jnp.arange(s)[None, :, None, None] >= kvl[:, None, None, None]
  k, v = jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v)
  kw = dict(scale=d ** -0.5, heads_major=heads_major, lanes=lanes, stages=stages)
  base = attention_mosaic.forward(q, k, v, pos, kvl, persistent=False, **kw)
  for call in range(2):
    got = attention_mosaic.forward(q, k, v, pos, kvl, persistent=True, **kw)
    for name, x, y in zip(("out", "lse"), base, got):
      assert np.all(np.isfinite(np.asarray(y, np.float32))), name
      assert_bitwise_equal(y, x, f"{name}: persistent CTAs vs one CTA per item, call {call}")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rows", [1, 4, 7, 12, 16, 70, 130, 200])
def test_heads_major_keeps_the_bits(d, rows):
  """q as ``[B, H, R, D]`` (the decode layout: no padded copy of the rows when R <= 8 or
  R % 8 == 0, the block past R read as TMA zeros and its output clipped) gives the
  ``[B, R, H, D]`` call's bits, out and lse, with NaN past kv_lengths and rows at
  positions from -1 to the end of the cache; and float64 accuracy. R = 12 pads its rows
  to 16; R = 70 fills both warpgroups of one CTA block; R = 130 and 200 take two CTA
  blocks, R = 130 with a warpgroup's 64 rows wholly past the array. Rows past R see no
  key whatever is read there; a store past R would overwrite the next head's rows, which
  the comparison catches (when that head's CTA ran first)."""
  b, s, h = 3, 300, 2
  ks = jax.random.split(jax.random.key(rows), 4)
  q = jax.random.normal(ks[0], (b, rows, h, d)).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, h, d)).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, h, d)).astype(jnp.bfloat16)
  pos = jax.random.randint(ks[3], (b, rows), -1, s).astype(jnp.int32)
  kvl = jnp.array([300, 129, 1], jnp.int32)
  ref = reference64(q, k, v, pos, kvl, d ** -0.5)
  past = jnp.arange(s)[None, :, None, None] >= kvl[:, None, None, None]
  k, v = jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v)
  out, lse = attention_mosaic.forward(q, k, v, pos, kvl, scale=d ** -0.5)
  out_h, lse_h = attention_mosaic.forward(q.transpose(0, 2, 1, 3), k, v, pos, kvl,
                                          scale=d ** -0.5, heads_major=True)
  assert out_h.shape == (b, h, rows, d) and lse_h.shape == lse.shape
  assert np.all(np.isfinite(np.asarray(out_h, np.float32)))
  assert_bitwise_equal(out_h.transpose(0, 2, 1, 3), out, "heads-major out")
  assert_bitwise_equal(lse_h, lse, "heads-major lse")
  assert rel_err(out, ref) <= TOL["bfloat16"][0]
  if rows <= 64 and d == 64:
    two, _ = attention_mosaic.forward(q.transpose(0, 2, 1, 3), k, v, pos, kvl,
                                      scale=d ** -0.5, heads_major=True, lanes=2)
    assert_bitwise_equal(two, out_h, "heads-major, two lanes")


def test_decode_step_gradients_through_the_heads_major_layout():
  """A one-query call (``causal_attention`` gives the Mosaic forward its heads as rows,
  heads-major) has the gradients of the same call in the row-major layout, bitwise."""
  from jaxrl_kernels.attention import api
  b, s, hq, hkv, d = 2, 200, 8, 2, 64
  ks = jax.random.split(jax.random.key(5), 4)
  q = jax.random.normal(ks[0], (b, 1, hq, d)).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, hkv, d)).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, hkv, d)).astype(jnp.bfloat16)
  pos = jnp.array([[199], [60]], jnp.int32)
  kvl = jnp.array([200, 61], jnp.int32)
  g = hq // hkv

  # A random cotangent: a wrong layout of d_out (or of dq) changes the gradients.
  w = jax.random.normal(ks[3], (b, 1, hq, d))

  def decode(q, k, v):
    out = causal_attention(q, k, v, q_positions=pos, kv_lengths=kvl, implementation="mosaic")
    return (out.astype(jnp.float32) * w).sum()

  def row_major(q, k, v):
    rows = q.reshape(b, 1, hkv, g, d).transpose(0, 1, 3, 2, 4).reshape(b, g, hkv, d)
    out = api._attention(rows, k, v, jnp.repeat(pos, g, axis=1), kvl,
                         api._Static(d ** -0.5, "mosaic"))
    out = out.reshape(b, 1, g, hkv, d).transpose(0, 1, 3, 2, 4).reshape(b, 1, hq, d)
    return (out.astype(jnp.float32) * w).sum()

  want = jax.grad(row_major, argnums=(0, 1, 2))(q, k, v)
  got = jax.grad(decode, argnums=(0, 1, 2))(q, k, v)
  for name, x, y in zip(("dq", "dk", "dv"), got, want):
    assert_bitwise_equal(x, y, name)
  assert float(jnp.abs(got[0].astype(jnp.float32)).sum()) > 0


def test_lse_matches_triton_and_gradients():
  """The Mosaic forward's residuals drive the Mosaic backward: gradients within
  tolerance."""
  q, k, v = inputs(1, 2, 300, HQ, 2, D, jnp.bfloat16, spread=2)
  pos = arange_pos(2, 300)
  kvl = jnp.array([300, 211], jnp.int32)
  args = (q, k, v, pos, kvl)
  _, lse_m = attention_mosaic.forward(*args, scale=D ** -0.5)
  _, lse_t = attention_triton.forward(*args, scale=D ** -0.5, interpret=False)
  assert lse_m.shape == lse_t.shape == (2, HQ, 300)
  np.testing.assert_allclose(np.asarray(lse_m), np.asarray(lse_t), rtol=1e-4, atol=1e-3)
  d_out = jax.random.normal(jax.random.key(2), q.shape, jnp.bfloat16)
  out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, pos, kvl), q, k, v)
  grads = vjp(d_out)
  ref_out, ref_grads = reference64(q, k, v, pos, kvl, D ** -0.5, d_out)
  assert rel_err(out, ref_out) <= TOL["bfloat16"][0]
  for name, g, r in zip("qkv", grads, ref_grads):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    assert rel_err(g, r) <= TOL["bfloat16"][1], name


def test_default_and_routing():
  """Hopper default: mosaic for bf16 D=128, triton for a head dim mosaic does not take."""
  q, k, v = inputs(9, 1, 200, HQ, HQ, D, jnp.bfloat16)
  assert_bitwise_equal(attn(q, k, v, impl=None), attn(q, k, v, impl="mosaic"), "default")
  q, k, v = inputs(9, 1, 200, HQ, HQ, 96, jnp.bfloat16)
  assert_bitwise_equal(attn(q, k, v, impl=None), attn(q, k, v, impl="triton"), "D=96")
  with pytest.raises(ValueError, match="head dim 96"):
    attn(q, k, v, impl="mosaic")
  with pytest.raises(TypeError, match="mosaic"):
    attn(*(x.astype(jnp.float32) for x in (q, k, v)), impl="mosaic")


def test_backward_routes_by_head_dim():
  """The backward runs the Mosaic kernels at a head dim of BACKWARD_HEAD_DIMS and the
  Triton backward otherwise: bitwise equal to the chosen kernels (as many query as kv
  heads)."""
  for d in (64, 128):
    q, k, v = inputs(4, 2, 200, HQ, HQ, d, jnp.bfloat16, spread=2)
    pos, kvl = arange_pos(2, 200), jnp.array([200, 131], jnp.int32)
    d_out = jax.random.normal(jax.random.key(5), q.shape, jnp.bfloat16)
    out, lse = attention_mosaic.forward(q, k, v, pos, kvl, scale=d ** -0.5)
    got = attention_mosaic_bwd.backward(q, k, v, pos, kvl, out, lse, d_out, scale=d ** -0.5)
    tri = attention_triton.backward(q, k, v, pos, kvl, out, lse, d_out, scale=d ** -0.5,
                                    interpret=False)
    dq, delta = attention_mosaic_bwd.dq(q, k, v, pos, kvl, d_out, lse, out, scale=d ** -0.5)
    mos = (dq, *attention_mosaic_bwd.dkv(q, k, v, pos, kvl, d_out, lse, delta, scale=d ** -0.5))
    want = mos if d in attention_mosaic_bwd.BACKWARD_HEAD_DIMS else tri
    other = tri if d in attention_mosaic_bwd.BACKWARD_HEAD_DIMS else mos
    for name, g, w, o in zip("qkv", got, want, other):
      assert_bitwise_equal(g, w, f"d{name} D={d}")
      # control: the two backwards differ, so the equality above names the route
      assert not np.array_equal(np.asarray(g).view(np.uint16), np.asarray(o).view(np.uint16))


@pytest.mark.parametrize("d,hq,hkv", [(64, 14, 2), (128, 12, 2)])
def test_long_grouped_calls_keep_the_folded_bits(d, hq, hkv):
  """From api.UNFOLDED_MIN_QUERIES queries on, grouped heads reach the Mosaic forward
  unfolded: every output and dq row has the bits of the folded kernel call (both backwards
  take the grouped heads as they are; dQ and delta are per row). dK/dV sum the group's rows
  in another order: equal to the folded call's to rounding."""
  from jaxrl_kernels.attention import api

  t, g = 600, hq // hkv
  assert t >= api.UNFOLDED_MIN_QUERIES
  q, k, v = inputs(6, 2, t, hq, hkv, d, jnp.bfloat16, spread=2)
  pos, kvl = arange_pos(2, t), jnp.array([t, t - 123], jnp.int32)
  st = api._Static(d ** -0.5, IMPL)

  def public(q, k, v):
    return attn(q, k, v, pos, kvl)

  def folded(q, k, v):
    out = api._attention(attention_triton.fold_groups(q, g), k, v,
                         jnp.repeat(pos, g, axis=1), kvl, st)
    return attention_triton.unfold_groups(out, g)

  assert_bitwise_equal(jax.jit(public)(q, k, v), jax.jit(folded)(q, k, v), "output")
  w = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w),
                                    argnums=(0, 1, 2)))(q, k, v)
  got, want = grad(public), grad(folded)
  assert_bitwise_equal(got[0], want[0], "dq")
  for name, x, y in (("dk", got[1], want[1]), ("dv", got[2], want[2])):
    assert rel_err(x, np.asarray(y, np.float64)) <= TOL["bfloat16"][1], name


def _dkv_inputs(seed, b, t, h, d, pos, kvl, hkv=None):
  """Inputs of the dK/dV kernel (``h`` query heads, ``hkv`` kv heads: ``h`` unless given)
  and the float64 reference's dk, dv."""
  q, k, v = inputs(seed, b, t, h, hkv or h, d, jnp.bfloat16, spread=2)
  d_out = jax.random.normal(jax.random.key(seed + 1), q.shape, jnp.bfloat16)
  scale = d ** -0.5
  out, lse = attention_mosaic.forward(q, k, v, pos, kvl, scale=scale)
  delta = attention_triton.delta_rows(out, d_out)
  _, (_, dk_ref, dv_ref) = reference64(q, k, v, pos, kvl, scale, d_out)
  return (q, k, v, pos, kvl, d_out, lse, delta), scale, (dk_ref, dv_ref)


@pytest.mark.parametrize("d,t,h,hkv", [(64, 777, 2, 2), (128, 300, 2, 2), (128, 777, 6, 2)])
def test_dkv_kernel_matches_float64_for_every_range_split(d, t, h, hkv):
  """dK/dV within the gradient tolerance of float64 (T off the tiles, a shorter kv_len;
  grouped heads as they are), for one range of query rows per key CTA and for ranges of
  64, 192 and 576 rows (partials summed in range order; with 3 heads per group: 1, 1 and 3
  blocks of each head); each split run to run bitwise, and the splits agree to float32
  rounding."""
  pos = arange_pos(2, t)
  kvl = jnp.array([t, t - 123], jnp.int32)
  args, scale, refs = _dkv_inputs(3, 2, t, h, d, pos, kvl, hkv)
  results = {}
  for split in (4096, 64, 192, 576):
    f = jax.jit(lambda *a, split=split: attention_mosaic_bwd.dkv(*a, scale=scale,
                                                                  split_rows=split))
    got = f(*args)
    assert_bitwise_equal(got[0], f(*args)[0], f"dk run to run, split {split}")
    for name, g, r in zip(("dk", "dv"), got, refs, strict=True):
      assert np.all(np.isfinite(np.asarray(g, np.float32))), (name, split)
      assert rel_err(g, r) <= TOL["bfloat16"][1], (name, split)
    results[split] = got
  for name, a, c in zip(("dk", "dv"), results[4096], results[64], strict=True):
    assert rel_err(a, c) <= 1e-2, name


@pytest.mark.parametrize("d,t,h,hkv", [(64, 777, 2, 2), (128, 300, 2, 2), (128, 1000, 2, 2),
                                       (128, 600, 6, 2)])
def test_dkv_direct_stores_equal_the_one_range_sum(d, t, h, hkv):
  """With one range of query rows per key CTA the kernel writes dk and dv itself: the
  values of the float32 partial summed by attention_triton.sum_ranges (which adds it to
  +0, so only the sign of a zero may differ), zeros for keys past kv_len (no walk)."""
  pos = arange_pos(2, t)
  kvl = jnp.array([t, t - 123], jnp.int32)
  args, scale, _ = _dkv_inputs(19, 2, t, h, d, pos, kvl, hkv)
  run = {direct: jax.jit(lambda *a, direct=direct: attention_mosaic_bwd._dkv(
      *a, scale=scale, split_rows=4096, direct=direct))(*args) for direct in (True, False)}
  for name, a, c in zip(("dk", "dv"), run[True], run[False], strict=True):
    a32, c32 = np.asarray(a, np.float32), np.asarray(c, np.float32)
    assert np.array_equal(a32, c32), name
    assert not np.any(a32[1, t - 123:]), f"{name} past kv_len"
  with pytest.raises(ValueError, match="direct stores need one range"):
    attention_mosaic_bwd._dkv(*args, scale=scale, split_rows=128, direct=True)


def test_dkv_kernel_packed_positions_and_nan_padding():
  """Positions that restart mid-row (queries 300-549 at positions 0-249 see keys 0-249
  again; non-monotone), then padding at -1: the walk starts at the first block reaching a
  CTA's keys and then meets blocks that see none of them (exact zeros). NaN in the padding
  rows' q and dO changes no bit."""
  t = 700
  row = np.concatenate([np.arange(300), np.arange(250), np.full(150, -1)]).astype(np.int32)
  pos = jnp.asarray(np.stack([row, np.arange(t, dtype=np.int32)]))
  kvl = jnp.array([300, t], jnp.int32)
  args, scale, refs = _dkv_inputs(5, 2, t, 2, 64, pos, kvl)
  f = jax.jit(lambda *a: attention_mosaic_bwd.dkv(*a, scale=scale, split_rows=128))
  clean = f(*args)
  for name, g, r in zip(("dk", "dv"), clean, refs, strict=True):
    assert rel_err(g, r) <= TOL["bfloat16"][1], name
  pad = (pos < 0)[:, :, None, None]
  q, d_out = args[0], args[5]
  dirty = list(args)
  dirty[0] = jnp.where(pad, jnp.nan, q).astype(q.dtype)
  dirty[5] = jnp.where(pad, jnp.nan, d_out).astype(d_out.dtype)
  got = f(*dirty)
  for name, g, c in zip(("dk", "dv"), got, clean, strict=True):
    assert_bitwise_equal(g, c, f"{name} with NaN padding rows")


def test_backward_padding_rows_through_the_dq_kernels_delta():
  """The Mosaic backward at D = 128 with grouped heads (6 / 2) on positions that restart
  mid-row and then pad (-1): the dq kernel's delta is 0 on the padding rows and dq there
  is 0; NaN in the padding rows' q, out and dO changes no bit of dq, dk, dv; dk, dv within
  the gradient tolerance of float64."""
  t = 700
  row = np.concatenate([np.arange(300), np.arange(250), np.full(150, -1)]).astype(np.int32)
  pos = jnp.asarray(np.stack([row, np.arange(t, dtype=np.int32)]))
  kvl = jnp.array([300, t], jnp.int32)
  q, k, v = inputs(23, 2, t, 6, 2, 128, jnp.bfloat16, spread=2)
  d_out = jax.random.normal(jax.random.key(24), q.shape, jnp.bfloat16)
  scale = 128 ** -0.5
  out, lse = attention_mosaic.forward(q, k, v, pos, kvl, scale=scale)
  _, (_, dk_ref, dv_ref) = reference64(q, k, v, pos, kvl, scale, d_out)
  f = jax.jit(lambda q, out, d_out: attention_mosaic_bwd.backward(
      q, k, v, pos, kvl, out, lse, d_out, scale=scale))
  clean = f(q, out, d_out)
  _, delta = attention_mosaic_bwd.dq(q, k, v, pos, kvl, d_out, lse, out, scale=scale)
  assert not np.any(np.asarray(delta)[0, :, 550:])
  assert np.any(np.asarray(delta)[0, :, :550])
  assert not np.any(np.asarray(clean[0], np.float32)[0, 550:])
  for name, g, r in zip(("dk", "dv"), clean[1:], (dk_ref, dv_ref), strict=True):
    assert rel_err(g, r) <= TOL["bfloat16"][1], name
  pad = (pos < 0)[:, :, None, None]
  dirty = [jnp.where(pad, jnp.nan, x).astype(x.dtype) for x in (q, out, d_out)]
  for name, a, c in zip(("dq", "dk", "dv"), f(*dirty), clean, strict=True):
    assert_bitwise_equal(a, c, f"{name} with NaN padding rows")


@pytest.mark.parametrize("d,t,h,hkv", [(64, 777, 2, 2), (128, 300, 2, 2), (128, 300, 6, 2)])
def test_dq_kernel_matches_float64_and_ignores_garbage_keys(d, t, h, hkv):
  """dQ within the gradient tolerance of float64 (T off the tiles, a shorter kv_len), run to
  run bitwise; its delta = rowsum(dO * O) within float32 rounding of delta_rows; NaN in K
  and V rows past kv_len (a cache's garbage) changes no bit of dQ, nor of dK and dV with
  several ranges (partials) or one (stored by the kernel)."""
  pos = arange_pos(2, t)
  kvl = jnp.array([t, t - 123], jnp.int32)
  args, scale, _ = _dkv_inputs(7, 2, t, h, d, pos, kvl, hkv)
  _, (dq_ref, _, _) = reference64(*args[:5], scale, args[5])
  q, k, v, _, _, d_out, lse, delta_ref = args
  out, _ = attention_mosaic.forward(q, k, v, pos, kvl, scale=scale)
  f = jax.jit(lambda *a: attention_mosaic_bwd.dq(*a, scale=scale))
  dq_args = (*args[:7], out)
  got, delta = f(*dq_args)
  assert_bitwise_equal(got, f(*dq_args)[0], "dq run to run")
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  assert rel_err(got, dq_ref) <= TOL["bfloat16"][1]
  assert delta.shape == delta_ref.shape
  assert rel_err(delta, np.asarray(delta_ref, np.float64)) <= 1e-6
  past = (jnp.arange(t)[None, :] >= kvl[:, None])[:, :, None, None]
  dirty = list(dq_args)
  for i in (1, 2):
    dirty[i] = jnp.where(past, jnp.nan, args[i]).astype(args[i].dtype)
  assert_bitwise_equal(f(*dirty)[0], got, "dq with NaN keys past kv_len")
  dirty = list(args)
  for i in (1, 2):
    dirty[i] = jnp.where(past, jnp.nan, args[i]).astype(args[i].dtype)
  for split in (256, 4096):
    g = jax.jit(lambda *a, split=split: attention_mosaic_bwd.dkv(*a, scale=scale,
                                                                  split_rows=split))
    for name, a, c in zip(("dk", "dv"), g(*dirty), g(*args), strict=True):
      assert_bitwise_equal(a, c, f"{name} with NaN keys past kv_len, split {split}")


@pytest.mark.parametrize("t,hq,hkv", [(1000, HQ, HQ), (700, 6, 2), (300, 6, 2)])
def test_default_positions_keep_the_gradient_bits(t, hq, hkv):
  """Default positions and lengths let the dK/dV skip the pass that zeroes padding rows
  (``every_row_sees_a_key``): every gradient keeps the bits of the same positions and
  lengths passed explicitly (which run that pass), at MHA and grouped heads, unfolded and
  folded (300 queries: below ``api.UNFOLDED_MIN_QUERIES``); and NaN in a row whose
  explicit position is -1 still reaches no gradient of the general call (the control that
  the pass runs there)."""
  q, k, v = inputs(23, 2, t, hq, hkv, D, jnp.bfloat16, spread=2)
  d_out = jax.random.normal(jax.random.key(24), q.shape, jnp.bfloat16)

  @jax.jit
  def grads(q, k, v, pos, kvl, d_out):
    _, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, pos, kvl), q, k, v)
    return vjp(d_out)

  @jax.jit
  def grads_default(q, k, v, d_out):
    _, vjp = jax.vjp(lambda q, k, v: attn(q, k, v), q, k, v)
    return vjp(d_out)

  pos = arange_pos(2, t)
  kvl = jnp.full((2,), t, jnp.int32)
  for name, a, c in zip("qkv", grads_default(q, k, v, d_out), grads(q, k, v, pos, kvl, d_out),
                        strict=True):
    assert_bitwise_equal(a, c, f"d{name}")
  pad = pos.at[:, -1].set(-1)
  q_nan, do_nan = q.at[:, -1].set(jnp.nan), d_out.at[:, -1].set(jnp.nan)
  for name, g in zip("qkv", grads(q_nan, k, v, pad, kvl, do_nan), strict=True):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), f"d{name} with a NaN padding row"


@pytest.mark.parametrize("d", [64, 128])  # 128: the Mosaic backward; 64: the Triton one
@pytest.mark.parametrize("case", list(nonfinite.cases(5)))
def test_non_finite_scores_give_nan(case, d):
  """NaN or inf in q or a seen key, or an overflowing q . k: NaN outputs and gradients, as
  stock attention (tests/attention/nonfinite_cases.py); other rows keep their bits."""
  nonfinite.check_nan_propagates(IMPL, jnp.bfloat16, 5, d, case)


@pytest.mark.parametrize("d", [64, 128])
def test_unseen_content_is_inert_and_layouts_give_nan(d):
  """Padding inert; the default positions (the backward's every_row_sees_a_key hint) and a
  decode step (the heads-major layout) propagate NaN."""
  nonfinite.check_unseen_content_is_inert(IMPL, jnp.bfloat16, 5, d)
  nonfinite.check_default_positions_and_decode(IMPL, jnp.bfloat16, 5, d)
