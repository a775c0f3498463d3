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
  Triton backward otherwise: bitwise equal to the chosen kernels, on the folded layout."""
  for d in (64, 128):
    q, k, v = inputs(4, 2, 200, HQ, HQ, d, jnp.bfloat16, spread=2)
    pos, kvl = arange_pos(2, 200), jnp.array([200, 131], jnp.int32)
    d_out = jax.random.normal(jax.random.key(5), q.shape, jnp.bfloat16)
    out, lse = attention_mosaic.forward(q, k, v, pos, kvl, scale=d ** -0.5)
    got = attention_mosaic_bwd.backward(q, k, v, pos, kvl, out, lse, d_out, scale=d ** -0.5)
    tri = attention_triton.backward(q, k, v, pos, kvl, out, lse, d_out, scale=d ** -0.5,
                                    interpret=False)
    delta = attention_triton.delta_rows(out, d_out)
    mos = (attention_mosaic_bwd.dq(q, k, v, pos, kvl, d_out, lse, delta, scale=d ** -0.5),
           *attention_mosaic_bwd.dkv(q, k, v, pos, kvl, d_out, lse, delta, scale=d ** -0.5))
    want = mos if d in attention_mosaic_bwd.BACKWARD_HEAD_DIMS else tri
    other = tri if d in attention_mosaic_bwd.BACKWARD_HEAD_DIMS else mos
    for name, g, w, o in zip("qkv", got, want, other):
      assert_bitwise_equal(g, w, f"d{name} D={d}")
      # control: the two backwards differ, so the equality above names the route
      assert not np.array_equal(np.asarray(g).view(np.uint16), np.asarray(o).view(np.uint16))


def _dkv_inputs(seed, b, t, h, d, pos, kvl):
  """Folded-layout inputs of the dK/dV kernel and the float64 reference's dk, dv."""
  q, k, v = inputs(seed, b, t, h, h, d, jnp.bfloat16, spread=2)
  d_out = jax.random.normal(jax.random.key(seed + 1), q.shape, jnp.bfloat16)
  scale = d ** -0.5
  out, lse = attention_mosaic.forward(q, k, v, pos, kvl, scale=scale)
  delta = attention_triton.delta_rows(out, d_out)
  _, (_, dk_ref, dv_ref) = reference64(q, k, v, pos, kvl, scale, d_out)
  return (q, k, v, pos, kvl, d_out, lse, delta), scale, (dk_ref, dv_ref)


@pytest.mark.parametrize("d,t", [(64, 777), (128, 300)])
def test_dkv_kernel_matches_float64_for_every_range_split(d, t):
  """dK/dV within the gradient tolerance of float64 (T off the tiles, a shorter kv_len),
  for one range of query rows per key CTA and for ranges of 64 and 192 rows (partials
  summed in range order); each split run to run bitwise, and the splits agree to
  float32 rounding."""
  pos = arange_pos(2, t)
  kvl = jnp.array([t, t - 123], jnp.int32)
  args, scale, refs = _dkv_inputs(3, 2, t, 2, d, pos, kvl)
  results = {}
  for split in (4096, 64, 192):
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


@pytest.mark.parametrize("d,t", [(64, 777), (128, 300)])
def test_dq_kernel_matches_float64_and_ignores_garbage_keys(d, t):
  """dQ within the gradient tolerance of float64 (T off the tiles, a shorter kv_len), run to
  run bitwise; NaN in K and V rows past kv_len (a cache's garbage) changes no bit of dQ,
  dK or dV."""
  pos = arange_pos(2, t)
  kvl = jnp.array([t, t - 123], jnp.int32)
  args, scale, _ = _dkv_inputs(7, 2, t, 2, d, pos, kvl)
  _, (dq_ref, _, _) = reference64(*args[:5], scale, args[5])
  f = jax.jit(lambda *a: attention_mosaic_bwd.dq(*a, scale=scale))
  got = f(*args)
  assert_bitwise_equal(got, f(*args), "dq run to run")
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  assert rel_err(got, dq_ref) <= TOL["bfloat16"][1]
  past = (jnp.arange(t)[None, :] >= kvl[:, None])[:, :, None, None]
  dirty = list(args)
  for i in (1, 2):
    dirty[i] = jnp.where(past, jnp.nan, args[i]).astype(args[i].dtype)
  assert_bitwise_equal(f(*dirty), got, "dq with NaN keys past kv_len")
  g = jax.jit(lambda *a: attention_mosaic_bwd.dkv(*a, scale=scale, split_rows=256))
  for name, a, c in zip(("dk", "dv"), g(*dirty), g(*args), strict=True):
    assert_bitwise_equal(a, c, f"{name} with NaN keys past kv_len")
