"""linear_logp's Mosaic backend on Hopper (TMA + wgmma, partials epilogue): what only this
backend has to prove.

Its place in the dispatch table (Hopper bf16/fp16 default; its GEMM backward), accuracy of
the outputs, gradients and raw tile partials against float64, its free knobs (rows per
CTA, CTA walk, pipeline depth) never changing a bit, and the sampler path through its
logits-store epilogue (head_logits, logits_logp) bitwise equal to the fused op. Every
invariance (batch with dH rows, position, padding, chunking, mode, run to run, vocab
shards, traced temperature) is tests/test_contract.py, at realistic shapes on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows

from jaxrl_kernels.linear_logp import BackwardConfig, api, linear_logp, tile_partials
from jaxrl_kernels.linear_logp.logits import head_logits, logits_logp
from jaxrl_kernels.linear_logp.reference import linear_logp_reference
from jaxrl_kernels.pallas import linear_logp_mosaic as lm

pytestmark = pytest.mark.hopper

IMPL = "mosaic"
H = 512
V = 3001  # not a multiple of the vocab tile (and padded for TMA in both layouts)


def _weight(layout, v=V, dtype=jnp.bfloat16, seed=1):
  w = jax.random.normal(jax.random.key(seed), (H, v), jnp.float32) * (2.0 / np.sqrt(H))
  return (w if layout == "hv" else w.T).astype(dtype)


def _wide(t, seed=3, v=V):
  x = wide_rows(jax.random.key(seed), t, H, jnp.bfloat16, spread=4)
  return x, jax.random.randint(jax.random.key(seed + 1), (t,), 0, v)


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
  config asks; "triton" runs the Triton tile kernels, forward and backward, on Hopper bf16
  too."""
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
def test_tile_m_and_walk_keep_the_bits(layout):
  """The free knobs (rows per CTA, CTA walk, pipeline depth, warpgroups per CTA, hidden
  columns per pipeline step) never change a partial."""
  x, tg = _wide(700)
  w = _weight(layout)
  kw = dict(layout=layout, temperature=1.0, compute_dtype=jnp.bfloat16)
  ref = lm.tile_partials(x, w, None, tg, **kw)
  for cfg in (lm.Config(tile_m=64), lm.Config(grid_minor="n"),
              lm.Config(tile_m=64, max_concurrent_steps=2, grid_tile_width=1),
              lm.Config(num_wgs=1), lm.Config(tile_m=64, num_wgs=1),
              lm.Config(tile_m=64, tile_k=128),
              lm.Config(num_wgs=1, tile_k=128),
              lm.Config(tile_m=64, num_wgs=1, tile_k=128, max_concurrent_steps=8)):
    got = lm.tile_partials(x, w, None, tg, config=cfg, **kw)
    for name, a, b in zip("msuz", got, ref):
      assert_bitwise_equal(a, b, f"{name} with {cfg}")


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_logits_of_few_rows_keep_the_bits(layout):
  """The sampler's logits kernel at <= 64 rows (64-row CTAs, CTAs of one warpgroup, 128
  hidden columns per step, hidden rows read in place) gives the rows of a 300-row call
  (128-row CTAs): logits and statistics bitwise."""
  x, _ = _wide(300)
  w = _weight(layout)
  kw = dict(layout=layout, temperature=0.7, compute_dtype=jnp.bfloat16, return_stats=True)
  z, (m, s, u) = lm.logits(x, w, None, **kw)
  one = lm.Config(tile_m=64, num_wgs=1)  # CTAs of one vocab tile: the same bits
  k128 = lm.Config(tile_m=64, num_wgs=1, tile_k=128)
  # Hidden rows read in place (TMA reads zeros past them) or, at 13 rows, padded.
  in_place = lm.Config(tile_m=64, hidden_in_place=True)
  in_place_k128 = lm.Config(tile_m=64, num_wgs=1, tile_k=128, hidden_in_place=True)
  for rows, config in ((1, None), (8, None), (13, None), (40, None), (64, None), (1, one),
                       (64, one), (1, k128), (40, k128), (1, in_place), (8, in_place),
                       (13, in_place), (3, in_place_k128), (40, in_place_k128)):
    z2, (m2, s2, u2) = lm.logits(x[:rows], w, None, **kw, config=config)
    assert_bitwise_equal(z2, z[:rows], f"logits, {rows} rows, {config}")
    for name, a, b in zip("msu", (m2, s2, u2), (m, s, u), strict=True):
      assert_bitwise_equal(a, b[:, :rows], f"{name}, {rows} rows, {config}")


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


@pytest.mark.parametrize("layout,v", [("hv", 3072), ("vh", 3072), ("vh", V)])
def test_logp_without_entropy_keeps_the_bits(layout, v):
  """A call that returns no entropy runs kernels without it: the fused partials leave ``u``
  out, the dz epilogue the entropy term (V = 3072: every backward product on the Mosaic
  kernel, the dz epilogue among them). The log-probs are bitwise those of the
  entropy-returning call and of the sampler (logits -> logits_logp); ``m``, ``s`` and the
  target logit are bitwise the entropy-reducing kernel's; the gradients equal (as values:
  the sign of an exact zero may differ) those of the entropy-returning call whose entropy
  the loss leaves unused."""
  x, t = _wide(300, v=v)
  w = _weight(layout, v)
  kw = dict(temperature=0.7, weight_layout=layout, implementation=IMPL)
  lp = linear_logp(x, w, t, **kw)
  lp_e, _ = linear_logp(x, w, t, return_entropy=True, **kw)
  assert_bitwise_equal(lp, lp_e, "logp without vs with the entropy")
  z = head_logits(x, w, temperature=0.7, weight_layout=layout, implementation=IMPL)
  assert_bitwise_equal(logits_logp(z, t, compute_dtype=jnp.bfloat16, implementation=IMPL), lp,
                       "sampler logp vs fused logp without the entropy")
  pkw = dict(layout=layout, temperature=0.7, compute_dtype=jnp.bfloat16)
  m0, s0, u0, tz0 = lm.tile_partials(x, w, None, t, entropy=False, **pkw)
  m1, s1, u1, tz1 = lm.tile_partials(x, w, None, t, **pkw)
  for name, a, b in (("m", m0, m1), ("s", s0, s1), ("target logit", tz0, tz1)):
    assert_bitwise_equal(a, b, f"{name} without vs with the entropy")
  assert np.all(np.asarray(u0) == 0) and np.any(np.asarray(u1) != 0)
  gl = jax.random.normal(jax.random.key(8), (300,))

  def grads(entropy):
    def loss(x, w):
      out = linear_logp(x, w, t, return_entropy=entropy, **kw)
      return jnp.sum((out[0] if entropy else out) * gl)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

  for name, a, b in zip(("dx", "dw"), grads(False), grads(True), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=name)


@pytest.mark.parametrize("t", [1, 64, 200, 256])
@pytest.mark.parametrize("layout,v,masked", [("hv", V, False), ("vh", V, False),
                                             ("hv", 3100, True), ("vh", 3100, True)])
def test_draw_in_the_head_kernel(t, layout, v, masked):
  """The draw in the LM head's epilogue (``logits_draw``, no logits in memory): its
  tokens, token logits and statistics are the same bits with 64- and 128-row CTAs; its
  statistics are bitwise those of the logits kernel; each token's logit is that token's
  stored logit exactly; the drawn tokens' log-probs from them are ``linear_logp``'s bitwise;
  the tokens are the stored-logits race's (``draw.draw_from_logits``) on every row whose
  two best race keys (float64, from the same noise words) are further apart than 1e-4,
  and on the others the kernel's token is one of those near-best. With a ``-inf`` bias
  over vocabulary tile 1 and single ids (V = 3100: 25 tiles, the last CTA's second tile
  past the vocabulary), no masked id is drawn."""
  from jaxrl_kernels.linear_logp.logits import LogitPartials, merge_logit_partials  # noqa: PLC0415
  from jaxrl_kernels.pallas import draw  # noqa: PLC0415
  from jaxrl_kernels.pallas import softmax_partials as sp  # noqa: PLC0415

  x, _ = _wide(t, v=v)
  w = _weight(layout, v=v)
  ids = np.zeros(v, bool)
  if masked:
    ids[128:256] = True
    ids[[0, 700, v - 1]] = True
  b = jnp.where(jnp.asarray(ids), -jnp.inf, 0.0) if masked else None
  seed = draw.seed_words(jax.random.key(5))
  kw = dict(layout=layout, temperature=0.7, compute_dtype=jnp.bfloat16)
  tokens, tz, stats = lm.logits_draw(x, w, b, seed, **kw)
  # The CTA's row count is a free knob: 128-row CTAs draw the same bits.
  wide = lm.logits_draw(x, w, b, seed, **kw, config=lm.Config(tile_m=128))
  for got, want, name in zip(jax.tree.leaves(wide), jax.tree.leaves((tokens, tz, stats)),
                             ("tokens", "token logits", "m", "s", "u"), strict=True):
    assert_bitwise_equal(got, want, f"{name} with 128-row CTAs")
  # So are the CTA's warpgroup count (CTAs of one vocab tile) and the hidden columns per
  # pipeline step: the same bits.
  for cfg in (lm.Config(tile_m=64, num_wgs=1),
              lm.Config(tile_m=64, num_wgs=1, tile_k=128)):
    one = lm.logits_draw(x, w, b, seed, **kw, config=cfg)
    for got, want, name in zip(jax.tree.leaves(one), jax.tree.leaves((tokens, tz, stats)),
                               ("tokens", "token logits", "m", "s", "u"), strict=True):
      assert_bitwise_equal(got, want, f"{name} with {cfg}")
  z, ref_stats = lm.logits(x, w, b, **kw, return_stats=True)
  for got, want, name in zip(stats, ref_stats, "msu", strict=True):
    assert_bitwise_equal(got, want, f"statistic {name}")
  tokens, zn = np.asarray(tokens), np.asarray(z)
  rows = np.arange(t)
  assert_bitwise_equal(tz, zn[rows, tokens], "token logits")
  k1, k2 = draw.row_keys(seed, jnp.arange(t))
  words = np.asarray(draw.noise_bits(k1[:, None], k2[:, None], jnp.arange(v)[None, :]))
  u = ((words.view(np.uint32) >> 9).astype(np.float64) + 0.5) / 2**23
  keys = zn.astype(np.float64) - np.log(-np.log(u))
  top2 = np.sort(keys, axis=1)[:, -2:]
  clear = top2[:, 1] - top2[:, 0] > 1e-4
  want_tokens = np.asarray(draw.draw_from_logits(z, seed, tile=lm.VOCAB_TILE)[0])
  assert np.array_equal(tokens[clear], want_tokens[clear])
  assert np.array_equal(tokens[clear], np.argmax(keys, axis=1)[clear])
  assert np.all(keys[rows, tokens] >= top2[:, 0] - 1e-4)
  assert not ids[tokens].any()
  merged = merge_logit_partials(LogitPartials(*stats), implementation=IMPL)
  logp, _ = sp.finalize(tz, merged.lse, merged.entropy, jnp.asarray(tokens), None, v)
  assert np.all(np.isfinite(np.asarray(logp)))
  want = linear_logp(x, w, jnp.asarray(tokens), bias=b, temperature=0.7,
                     weight_layout=layout, implementation=IMPL)
  assert_bitwise_equal(logp, want, "logp of the drawn tokens")
