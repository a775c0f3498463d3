"""linear_logp on a CUDA GPU (Triton lowering) at realistic shapes: accuracy, every
invariance bitwise, the materialized-XLA control, and the memory bound."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows

from jaxrl_kernels.linear_logp import linear_logp, merge_partials, tile_partials
from jaxrl_kernels.linear_logp.reference import linear_logp_reference

pytestmark = pytest.mark.gpu

IMPL = "triton"
H, V = 1024, 32003  # V not a multiple of the vocab tile


def _weight(dtype, layout, h=H, v=V, seed=1):
  w = jax.random.normal(jax.random.key(seed), (h, v), jnp.float32) * (2.0 / np.sqrt(h))
  return (w if layout == "hv" else w.T).astype(dtype)


def _wide(dtype, t, seed=3):
  x = wide_rows(jax.random.key(seed), t, H, dtype, spread=4)
  tg = jax.random.randint(jax.random.key(seed + 1), (t,), 0, V)
  return x, tg


def _fwd(layout):
  return jax.jit(lambda x, w, t: linear_logp(x, w, t, return_entropy=True, weight_layout=layout,
                                             implementation=IMPL))


def _dh(layout):
  def loss(x, w, t):
    lp, ent = linear_logp(x, w, t, return_entropy=True, weight_layout=layout,
                          implementation=IMPL)
    return jnp.sum(lp) + 0.3 * jnp.sum(ent)
  return jax.jit(jax.grad(loss))


@pytest.mark.parametrize("dtype,layout,fp32_head", [
    ("bfloat16", "hv", False), ("bfloat16", "vh", False), ("float32", "hv", False),
    ("bfloat16", "vh", True)])
def test_accuracy_vs_float64(dtype, layout, fp32_head):
  t = 513
  k = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(k[0], (t, H), jnp.float32).astype(dtype)
  w = _weight(dtype, layout)
  b = (jax.random.normal(k[1], (V,)) * 0.5).astype(dtype)
  tg = jax.random.randint(k[2], (t,), 0, V)
  mask = jax.random.bernoulli(k[3], 0.8, (t,))
  gl = jax.random.normal(k[4], (t,))

  def loss(x, w, b):
    lp, ent = linear_logp(x, w, tg, bias=b, mask=mask, temperature=0.8, return_entropy=True,
                          weight_layout=layout, fp32_head=fp32_head, implementation=IMPL)
    return jnp.sum(lp * gl) + 0.5 * jnp.sum(ent), (lp, ent)

  (_, (lp, ent)), (dx, dw, db) = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, b)
  ref = linear_logp_reference(x, w, tg, bias=b, mask=mask, temperature=0.8,
                              weight_layout=layout, g_logp=gl, g_ent=0.5 * np.ones(t))
  fwd_tol = TOL["float32"][0] if fp32_head else TOL[dtype][0]
  assert rel_err(lp, ref["logp"]) <= fwd_tol
  assert rel_err(ent, ref["entropy"]) <= fwd_tol
  small = np.abs(ref["logp"]) < 20
  assert np.max(np.abs(np.asarray(lp) - ref["logp"])[small]) <= 2e-2
  for got, key in ((dx, "dh"), (dw, "dw"), (db, "db")):
    assert rel_err(got, ref[key]) <= TOL[dtype][1], key


@pytest.mark.parametrize("dtype,layout", [("bfloat16", "hv"), ("bfloat16", "vh"),
                                          ("float32", "hv")])
def test_batch_invariance_sweep(dtype, layout):
  x, tg = _wide(dtype, 4096)
  w = _weight(dtype, layout)
  f, dh = _fwd(layout), _dh(layout)
  probe = (0, 1, 127, 128, 999)
  single = {r: f(x[r:r + 1], w, tg[r:r + 1]) for r in probe}
  single_dh = {r: dh(x[r:r + 1], w, tg[r:r + 1]) for r in probe}
  for m in (1000, 1777, 4096):
    lp, ent = f(x[:m], w, tg[:m])
    g = dh(x[:m], w, tg[:m])
    for r in probe:
      assert_bitwise_equal(lp[r:r + 1], single[r][0], f"logp row {r} of {m}")
      assert_bitwise_equal(ent[r:r + 1], single[r][1], f"entropy row {r} of {m}")
      assert_bitwise_equal(g[r:r + 1], single_dh[r], f"dH row {r} of {m}")


def test_position_padding_chunking_mode_run_to_run():
  x, tg = _wide("bfloat16", 512)
  w = _weight("bfloat16", "hv")
  f = _fwd("hv")
  lp, ent = f(x, w, tg)
  for pos in (0, 137, 511):
    xs = jnp.concatenate([x[:pos], x[300:301], x[pos:511]])
    ts = jnp.concatenate([tg[:pos], tg[300:301], tg[pos:511]])
    lp_p, ent_p = f(xs, w, ts)
    assert_bitwise_equal(lp_p[pos], lp[300], f"position {pos}")
    assert_bitwise_equal(ent_p[pos], ent[300], f"position {pos} entropy")
  junk = jax.random.normal(jax.random.key(8), (77, H), jnp.bfloat16)
  jt = jnp.zeros((77,), jnp.int32)
  lp_p, _ = f(jnp.concatenate([junk, x, junk]), w, jnp.concatenate([jt, tg, jt]))
  assert_bitwise_equal(lp_p[77:-77], lp, "padding")
  for cut in (1, 100, 256):
    parts = [f(x[:cut], w, tg[:cut])[0], f(x[cut:], w, tg[cut:])[0]]
    assert_bitwise_equal(jnp.concatenate(parts), lp, f"chunk {cut}")

  def loss(x, w):
    lp, ent = f(x, w, tg)
    return jnp.sum(lp) + jnp.sum(ent), (lp, ent)

  train = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  (_, (lp_t, ent_t)), grads = train(x, w)
  assert_bitwise_equal(lp_t, lp, "mode logp")
  assert_bitwise_equal(ent_t, ent, "mode entropy")
  for _ in range(20):
    assert_bitwise_equal(f(x, w, tg)[0], lp, "run-to-run logp")
  for _ in range(5):
    _, grads2 = train(x, w)
    assert_bitwise_equal(grads2[0], grads[0], "run-to-run dH")
    assert_bitwise_equal(grads2[1], grads[1], "run-to-run dW")


def test_vocab_split_merge_bits():
  x, tg = _wide("bfloat16", 1024)
  w = _weight("bfloat16", "vh")
  full = tile_partials(x, w, None, tg, weight_layout="vh", implementation=IMPL)
  ref = merge_partials(*full[:3], implementation=IMPL)
  for cuts in ((0, 16000, V), (0, 128 * 31, 128 * 125, V)):
    shards = [tile_partials(x, w[lo:hi], None, tg, weight_layout="vh", vocab_offset=lo,
                            implementation=IMPL) for lo, hi in zip(cuts[:-1], cuts[1:])]
    cat = [jnp.concatenate([s[i] for s in shards]) for i in range(3)]
    for got, want in zip(merge_partials(*cat, implementation=IMPL), ref):
      assert_bitwise_equal(got, want, f"merge {cuts}")
    assert_bitwise_equal(sum(s[3] for s in shards), full[3], f"target logit {cuts}")


def test_xla_control_changes_bits():
  """The materialized XLA path is not batch-invariant on these inputs (the
  invariance tests above can fail)."""
  x, tg = _wide("bfloat16", 4096)
  w = _weight("bfloat16", "hv")
  f = jax.jit(lambda x, t: linear_logp(x, w, t, return_entropy=True, implementation="xla"))
  changed = False
  for m in (1, 7, 64, 1000, 4096):
    lp, ent = f(x[:m], tg[:m])
    small_lp, small_ent = f(x[:1], tg[:1])
    changed |= not np.array_equal(bits(lp[:1]), bits(small_lp))
    changed |= not np.array_equal(bits(ent[:1]), bits(small_ent))
  assert changed, "materialized XLA gave the same bits at every batch size"


def test_temporaries_are_small_at_the_issue_shape():
  t, h, v = 8192, 4096, 151936
  spec = (jax.ShapeDtypeStruct((t, h), jnp.bfloat16), jax.ShapeDtypeStruct((h, v), jnp.bfloat16),
          jax.ShapeDtypeStruct((t,), jnp.int32))

  def temp(impl):
    def loss(a, w, tg):
      lp, ent = linear_logp(a, w, tg, return_entropy=True, implementation=impl)
      return jnp.sum(lp) + jnp.sum(ent)
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return fn.lower(*spec).compile().memory_analysis().temp_size_in_bytes

  fused, xla = temp(IMPL), temp("xla")
  # No [T, V] array: one float32 logits array alone is t * v * 4 bytes (4.6 GiB here), and
  # everything the fused op keeps is an order of magnitude below it. (The issue's 2%-of-XLA
  # target is a benchmark number: benchmarks/results/linear_logp_h100.md.)
  logits = t * v * 4
  assert fused <= 0.1 * logits, (f"fused temporaries {fused / 2**20:.0f} MiB vs one [T, V] "
                                 f"float32 array {logits / 2**20:.0f} MiB")
  assert fused <= 0.05 * xla, f"fused temporaries {fused / 2**20:.0f} MiB vs XLA {xla / 2**20:.0f}"
