"""linear_logp's Mosaic forward on Hopper (TMA + wgmma, partials epilogue): accuracy vs
float64, every invariance bitwise (rows, tile_m, vocab shards, mode), gradients, and the
sampler path (head_logits + logits_logp) bitwise equal to the fused op."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows
from tp_emulation import emulated_tp_logp

from jaxrl_kernels import _backend
from jaxrl_kernels.linear_logp import BackwardConfig, api, linear_logp, tile_partials
from jaxrl_kernels.linear_logp.logits import head_logits, logits_logp
from jaxrl_kernels.linear_logp.reference import linear_logp_reference
from jaxrl_kernels.pallas import linear_logp_mosaic as lm

pytestmark = pytest.mark.gpu

IMPL = "mosaic"
H = 512
V = 3001  # not a multiple of the vocab tile (and padded for TMA in both layouts)


@pytest.fixture(autouse=True)
def _hopper():
  if not _backend.is_hopper():
    pytest.skip("the Mosaic forward needs a Hopper GPU (sm_90)")


def _weight(layout, v=V, dtype=jnp.bfloat16, seed=1):
  w = jax.random.normal(jax.random.key(seed), (H, v), jnp.float32) * (2.0 / np.sqrt(H))
  return (w if layout == "hv" else w.T).astype(dtype)


def _wide(t, seed=3, v=V):
  x = wide_rows(jax.random.key(seed), t, H, jnp.bfloat16, spread=4)
  return x, jax.random.randint(jax.random.key(seed + 1), (t,), 0, v)


def _fwd(layout, **kw):
  return jax.jit(lambda x, w, t: linear_logp(x, w, t, return_entropy=True, weight_layout=layout,
                                             implementation=IMPL, **kw))


def test_resolution_on_hopper():
  # "mosaic" is the Hopper default for bf16/fp16 products; fp32 products resolve to Triton.
  for dt, want in ((jnp.bfloat16, "mosaic"), (jnp.float16, "mosaic"), (jnp.float32, "triton")):
    assert api.resolve("linear_logp", None, dt) == want
  assert api.resolve("linear_logp", "mosaic", jnp.bfloat16) == "mosaic"
  # fp32 products (fp32_head) have no Mosaic kernel (Triton runs them as 3xTF32).
  with pytest.raises(TypeError, match="mosaic"):
    api.resolve("linear_logp", "mosaic", jnp.float32)


def test_one_dispatch_table_names_forward_and_backward():
  """"mosaic" runs its GEMM backward by default and the Triton tile kernels only when the
  config asks; "triton" runs the Triton tile kernels (before, "triton" on Hopper bf16 ran
  the Mosaic GEMM backward)."""
  k = jax.random.split(jax.random.key(9), 3)
  x = jax.random.normal(k[0], (256, 512), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (512, 1024), jnp.float32) * 0.05).astype(jnp.bfloat16)
  tg = jax.random.randint(k[2], (256,), 0, 1024)

  def grad_jaxpr(impl, config=None):
    fn = jax.grad(lambda x: jnp.sum(linear_logp(x, w, tg, implementation=impl, config=config)))
    return str(jax.make_jaxpr(fn)(x))

  assert "linear_logp_dlogits" not in grad_jaxpr("mosaic")
  assert "linear_logp_dlogits" in grad_jaxpr("triton")
  assert "linear_logp_dlogits" in grad_jaxpr("mosaic", BackwardConfig(kernel="fused"))


@pytest.mark.parametrize("dtype,layout,v", [("bfloat16", "hv", V), ("bfloat16", "vh", V),
                                            ("float16", "hv", 2944), ("bfloat16", "vh", 2944)])
def test_accuracy_vs_float64(dtype, layout, v):
  t = 301  # not a multiple of the row tile
  k = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(k[0], (t, H), jnp.float32).astype(dtype)
  w = _weight(layout, v, dtype)
  b = (jax.random.normal(k[1], (v,)) * 0.5).astype(dtype)
  tg = jax.random.randint(k[2], (t,), 0, v)
  mask = jax.random.bernoulli(k[3], 0.8, (t,))
  gl = jax.random.normal(k[4], (t,))

  def loss(x, w, b):
    lp, ent = linear_logp(x, w, tg, bias=b, mask=mask, temperature=0.8, return_entropy=True,
                          weight_layout=layout, implementation=IMPL)
    return jnp.sum(lp * gl) + 0.5 * jnp.sum(ent), (lp, ent)

  (_, (lp, ent)), (dx, dw, db) = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, b)
  ref = linear_logp_reference(x, w, tg, bias=b, mask=mask, temperature=0.8,
                              weight_layout=layout, g_logp=gl, g_ent=0.5 * np.ones(t))
  assert rel_err(lp, ref["logp"]) <= TOL[dtype][0]
  assert rel_err(ent, ref["entropy"]) <= TOL[dtype][0]
  assert np.all(np.asarray(lp)[~np.asarray(mask)] == 0)
  small = np.abs(ref["logp"]) < 20
  assert np.max(np.abs(np.asarray(lp) - ref["logp"])[small]) <= 2e-2
  for got, key in ((dx, "dh"), (dw, "dw"), (db, "db")):
    assert rel_err(got, ref[key]) <= TOL[dtype][1], key


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_partials_vs_float64(layout):
  t = 200
  x, tg = _wide(t)
  x = x / 8  # moderate logits so that every tile's sums are well conditioned
  w = _weight(layout)
  b = jax.random.normal(jax.random.key(9), (V,)).astype(jnp.bfloat16)
  m, s, u, tz = tile_partials(x, w, b, tg, weight_layout=layout, temperature=0.7,
                              implementation=IMPL)
  n = -(-V // 128)
  assert m.shape == s.shape == u.shape == (n, t) and tz.shape == (t,)
  w64 = np.asarray(w, np.float64) if layout == "hv" else np.asarray(w, np.float64).T
  z = (np.asarray(x, np.float64) @ w64 + np.asarray(b, np.float64)) / 0.7
  zp = np.full((t, n * 128), -np.inf)
  zp[:, :V] = z
  zt = zp.reshape(t, n, 128)
  m_ref = zt.max(-1)
  e = np.exp(zt - m_ref[..., None])
  s_ref = e.sum(-1)
  u_ref = np.where(np.isfinite(zt), e * (zt - m_ref[..., None]), 0.0).sum(-1)
  assert rel_err(m, m_ref.T) <= TOL["bfloat16"][0]
  assert rel_err(s, s_ref.T) <= TOL["bfloat16"][0]
  assert rel_err(u, u_ref.T) <= TOL["bfloat16"][0]
  assert rel_err(tz, z[np.arange(t), np.asarray(tg)]) <= TOL["bfloat16"][0]
  # A shard that does not own a row's target gives exactly 0 for it.
  _, _, _, tz_far = tile_partials(x, w, b, tg, weight_layout=layout, temperature=0.7,
                                  vocab_offset=V, implementation=IMPL)
  assert np.all(np.asarray(tz_far) == 0)


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_batch_invariance_sweep(layout):
  x, tg = _wide(1000)
  w = _weight(layout)
  f = _fwd(layout)

  def dh_fn(x, w, t):
    lp, ent = linear_logp(x, w, t, return_entropy=True, weight_layout=layout,
                          implementation=IMPL)
    return jnp.sum(lp) + 0.3 * jnp.sum(ent)

  dh = jax.jit(jax.grad(dh_fn))
  probe = (0, 1, 63, 64, 127, 128, 999)
  single = {r: f(x[r:r + 1], w, tg[r:r + 1]) for r in probe}
  single_dh = {r: dh(x[r:r + 1], w, tg[r:r + 1]) for r in probe}
  for mm in (1000, 777, 130):
    lp, ent = f(x[:mm], w, tg[:mm])
    g = dh(x[:mm], w, tg[:mm])
    for r in probe:
      if r >= mm:
        continue
      assert_bitwise_equal(lp[r:r + 1], single[r][0], f"logp row {r} of {mm}")
      assert_bitwise_equal(ent[r:r + 1], single[r][1], f"entropy row {r} of {mm}")
      assert_bitwise_equal(g[r:r + 1], single_dh[r], f"dH row {r} of {mm}")


def test_position_padding_chunking_mode_run_to_run():
  x, tg = _wide(512)
  w = _weight("hv")
  b = jax.random.normal(jax.random.key(5), (V,)).astype(jnp.bfloat16)
  f = jax.jit(lambda x, t: linear_logp(x, w, t, bias=b, temperature=0.9, return_entropy=True,
                                       implementation=IMPL))
  lp, ent = f(x, tg)
  for pos in (0, 137, 511):
    xs = jnp.concatenate([x[:pos], x[300:301], x[pos:511]])
    ts = jnp.concatenate([tg[:pos], tg[300:301], tg[pos:511]])
    lp_p, ent_p = f(xs, ts)
    assert_bitwise_equal(lp_p[pos], lp[300], f"position {pos}")
    assert_bitwise_equal(ent_p[pos], ent[300], f"position {pos} entropy")
  junk = jax.random.normal(jax.random.key(8), (77, H), jnp.bfloat16)
  jt = jnp.zeros((77,), jnp.int32)
  lp_p, _ = f(jnp.concatenate([junk, x, junk]), jnp.concatenate([jt, tg, jt]))
  assert_bitwise_equal(lp_p[77:-77], lp, "padding")
  for cut in (1, 100, 256):
    parts = [f(x[:cut], tg[:cut])[0], f(x[cut:], tg[cut:])[0]]
    assert_bitwise_equal(jnp.concatenate(parts), lp, f"chunk {cut}")

  def loss(x, w):
    lp, ent = linear_logp(x, w, tg, bias=b, temperature=0.9, return_entropy=True,
                          implementation=IMPL)
    return jnp.sum(lp) + jnp.sum(ent), (lp, ent)

  (_, (lp_t, ent_t)), _ = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
  assert_bitwise_equal(lp_t, lp, "mode logp")
  assert_bitwise_equal(ent_t, ent, "mode entropy")
  # Forward-only without the entropy: the same logp bits.
  lp_only = jax.jit(lambda x, t: linear_logp(x, w, t, bias=b, temperature=0.9,
                                              implementation=IMPL))(x, tg)
  assert_bitwise_equal(lp_only, lp, "logp without entropy")
  for _ in range(20):
    assert_bitwise_equal(f(x, tg)[0], lp, "run-to-run logp")


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_tile_m_and_walk_keep_the_bits(layout):
  """The free knobs (rows per CTA, CTA walk, pipeline depth) never change a partial."""
  x, tg = _wide(700)
  w = _weight(layout)
  kw = dict(layout=layout, temperature=1.0, compute_dtype=jnp.bfloat16)
  ref = lm.tile_partials(x, w, None, tg, **kw)
  for cfg in (lm.MosaicLogpConfig(tile_m=64), lm.MosaicLogpConfig(grid_minor="n"),
              lm.MosaicLogpConfig(tile_m=64, max_concurrent_steps=2, grid_tile_width=1)):
    got = lm.tile_partials(x, w, None, tg, config=cfg, **kw)
    for name, a, b in zip("msuz", got, ref):
      assert_bitwise_equal(a, b, f"{name} with {cfg}")


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_emulated_tp_on_one_gpu_is_bitwise(tp, layout):
  x, tg = _wide(333)
  w = _weight(layout)
  ref_lp, ref_ent = linear_logp(x, w, tg, return_entropy=True, weight_layout=layout,
                                implementation=IMPL)
  lp, ent = emulated_tp_logp(x, w, tg, tp, V, layout=layout, implementation=IMPL)
  assert_bitwise_equal(lp, ref_lp, f"emulated TP={tp} logp")
  assert_bitwise_equal(ent, ref_ent, f"emulated TP={tp} entropy")


def test_xla_control_changes_bits():
  """The materialized XLA path is not batch-invariant on these inputs. A deep H (8192):
  at H = 512 cuBLAS ran the same kernel for every M on an H100 (session 4) and the
  control saw no change; with a deep K it picks split-K / other tiles by M."""
  h, v = 8192, 1024
  x = wide_rows(jax.random.key(21), 4096, h, jnp.bfloat16)
  w = jax.random.normal(jax.random.key(22), (h, v)).astype(jnp.bfloat16) * 0.05
  tg = jax.random.randint(jax.random.key(23), (4096,), 0, v)
  f = jax.jit(lambda x, t: linear_logp(x, w, t, return_entropy=True, implementation="xla"))
  changed = False
  for r in range(4):
    small_lp, small_ent = f(x[r:r + 1], tg[r:r + 1])
    lp, ent = f(x, tg)
    changed |= not np.array_equal(bits(lp[r:r + 1]), bits(small_lp))
    changed |= not np.array_equal(bits(ent[r:r + 1]), bits(small_ent))
  assert changed, "materialized XLA gave the same bits at M = 1 and M = 4096"


@pytest.mark.parametrize("layout,bias", [("hv", True), ("vh", False)])
def test_sampler_path_is_the_fused_op_bitwise(layout, bias):
  """head_logits -> logits_logp (the sampler) == linear_logp (the trainer), bit for bit."""
  x, _ = _wide(300)
  w = _weight(layout)
  b = jax.random.normal(jax.random.key(5), (V,)).astype(jnp.bfloat16) if bias else None
  z = head_logits(x, w, bias=b, temperature=0.7, weight_layout=layout, implementation=IMPL)
  assert z.shape == (300, V) and z.dtype == jnp.float32
  t = jnp.argmax(z, axis=-1)
  t = t.at[::3].set(jax.random.randint(jax.random.key(2), (100,), 0, V))
  lp_s, ent_s = logits_logp(z, t, return_entropy=True, compute_dtype=jnp.bfloat16,
                            implementation=IMPL)
  lp_f, ent_f = linear_logp(x, w, t, bias=b, temperature=0.7, return_entropy=True,
                            weight_layout=layout, implementation=IMPL)
  assert_bitwise_equal(lp_s, lp_f, "sampler logp vs fused logp")
  assert_bitwise_equal(ent_s, ent_f, "sampler entropy vs fused entropy")
  # The logits are the fused kernel's z: its target logit read out for every column.
  rows = jnp.repeat(x[:4], V, axis=0)
  cols = jnp.tile(jnp.arange(V, dtype=jnp.int32), 4)
  _, _, _, tz = tile_partials(rows, w, b, cols, weight_layout=layout, temperature=0.7,
                              implementation=IMPL)
  assert_bitwise_equal(z[:4], tz.reshape(4, V), "head_logits vs fused z")
  # Control: stock log_softmax of the same logits reduces in another order.
  lp_x = jax.nn.log_softmax(z, axis=-1)[jnp.arange(300), t]
  assert not np.array_equal(bits(lp_x), bits(lp_f))


@pytest.mark.parametrize("impl", ["mosaic", "triton"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_traced_temperature_has_the_static_bits_gpu(impl, temperature):
  """The temperature reaches every kernel as an operand (1 / temperature): the same value
  gives the same bits static or traced, forward, dH and sampler logits."""
  k = jax.random.split(jax.random.key(11), 3)
  x = jax.random.normal(k[0], (200, 512), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (512, 1000), jnp.float32) * 0.05).astype(jnp.bfloat16)
  tg = jax.random.randint(k[2], (200,), 0, 1000)

  def out(x, t):
    lp, ent = linear_logp(x, w, tg, temperature=t, return_entropy=True, implementation=impl)
    g = jax.grad(lambda x: jnp.sum(linear_logp(x, w, tg, temperature=t,
                                               implementation=impl)))(x)
    return lp, ent, g, head_logits(x, w, temperature=t, implementation=impl)

  static = jax.jit(lambda x: out(x, temperature))(x)
  traced = jax.jit(out)(x, jnp.float32(temperature))
  for name, s_, t_ in zip(("logp", "entropy", "dH", "logits"), static, traced):
    assert_bitwise_equal(s_, t_, f"{impl} {name}: static vs traced temperature")
