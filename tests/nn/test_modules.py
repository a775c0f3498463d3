"""LMHead and TinyCausalLM: values vs float64, logits/log-prob bit agreement, fp32 head,
batch invariance of the decoder's per-token log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows

from jaxrl_kernels.gemm import det_matmul
from jaxrl_kernels.linear_logp import tile_partials
from jaxrl_kernels.linear_logp.reference import linear_logp_reference
from jaxrl_kernels.nn.lm_head import LMHead, logp_from_stats
from jaxrl_kernels.nn.tiny_lm import TinyCausalLM, TinyLMConfig

H, V, T = 64, 200, 37  # V spans two vocab tiles, the second one ragged


def _head(dtype, tied, *, fp32_head=False, seed=0):
  emb = None
  if tied:
    emb = nnx.Param((0.3 * jax.random.normal(jax.random.key(seed + 7), (V, H))).astype(dtype))
  head = LMHead(H, V, tied_embedding=emb, use_bias=not tied, fp32_head=fp32_head,
                param_dtype=dtype, rngs=nnx.Rngs(seed))
  if head.bias is not None:
    head.bias.set_value(jax.random.normal(jax.random.key(seed + 1), (V,)).astype(dtype))
  return head


def _weight(head):
  return head.weight(), head.weight_layout


def _fused_logits(head, h):
  """The logits the fused kernel reduces, read out exactly: ``tile_partials``'s
  target logit ``z[t]`` (an exact masked sum), with every row repeated for every t
  (the device's default implementation, as the head's)."""
  w, layout = _weight(head)
  hr = jnp.repeat(head.hidden(h), V, axis=0)
  tg = jnp.tile(jnp.arange(V, dtype=jnp.int32), h.shape[0])
  b = None if head.bias is None else head.bias[...]
  _, _, _, tz = tile_partials(hr, w, b, tg, weight_layout=layout,
                              compute_dtype=head.compute_dtype,
                              implementation=head.implementation)
  return tz.reshape(h.shape[0], V)


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_values_vs_float64(tied):
  head = _head(jnp.float32, tied)
  h = jax.random.normal(jax.random.key(3), (3, 5, H))
  t = jax.random.randint(jax.random.key(4), (3, 5), 0, V)
  mask = jnp.arange(5)[None, :] < jnp.array([[5], [2], [0]])
  w, layout = _weight(head)
  b = None if head.bias is None else head.bias[...]
  ref = linear_logp_reference(h, w, t, bias=b, mask=mask, weight_layout=layout, temperature=0.8)
  logp, ent = head(h, t, mask, temperature=0.8, return_entropy=True)
  assert logp.shape == ent.shape == (3, 5) and logp.dtype == jnp.float32
  assert rel_err(logp, ref["logp"]) <= TOL["float32"][0]
  assert rel_err(ent, ref["entropy"]) <= TOL["float32"][0]
  assert np.all(np.asarray(logp)[~np.asarray(mask)] == 0)
  z = head.logits(h, temperature=0.8)
  w64 = np.asarray(w, np.float64) if layout == "hv" else np.asarray(w, np.float64).T
  z_ref = np.asarray(h, np.float64) @ w64 + (0 if b is None else np.asarray(b, np.float64))
  assert z.shape == (3, 5, V) and z.dtype == jnp.float32
  assert rel_err(z, z_ref / 0.8) <= TOL["float32"][0]


def test_tied_head_reads_the_embedding_variable():
  emb = nnx.Param(jax.random.normal(jax.random.key(0), (V, H)))
  head = LMHead(H, V, tied_embedding=emb, rngs=nnx.Rngs(0))
  assert head.kernel is None and head.weight_layout == "vh"
  untied = LMHead(H, V, rngs=nnx.Rngs(0))
  untied.kernel.set_value(emb[...].T)  # same numbers, [H, V] layout
  h = jax.random.normal(jax.random.key(1), (9, H))
  t = jnp.arange(9) * 17
  assert rel_err(head(h, t), untied(h, t)) <= TOL["float32"][0]
  emb.set_value(emb[...] * 2)  # the head sees the shared variable, not a copy
  assert rel_err(head(h, t), untied(h, t)) > 1e-3
  with pytest.raises(ValueError, match=r"tied_embedding must be \[vocab, hidden\]"):
    LMHead(H, V + 1, tied_embedding=emb, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dtype,tied,fp32_head", [(jnp.float32, False, False),
                                                  (jnp.bfloat16, True, False),
                                                  (jnp.bfloat16, False, True)])
def test_logits_are_the_fused_projection_bitwise(dtype, tied, fp32_head):
  head = _head(dtype, tied, fp32_head=fp32_head)
  h = wide_rows(jax.random.key(5), 6, H, jnp.float32 if fp32_head else dtype, spread=4)
  assert_bitwise_equal(head.logits(h), _fused_logits(head, h), "logits vs fused tile logits")


def test_det_matmul_projection_differs_control():
  """Why .logits does not call det_matmul: on the Pallas paths its fp32 K tile (32) is
  not the fused kernel's H step (64 in interpret mode), so the projections differ in
  bits (the interpreted kernels, the semantics of the Triton ones)."""
  head = _head(jnp.float32, False)
  head.bias = None
  head.implementation = "interpret"
  h = wide_rows(jax.random.key(5), 6, H, jnp.float32)
  z_gemm = det_matmul(h, head.kernel[...], out_dtype=jnp.float32, implementation="interpret")
  assert not np.array_equal(bits(z_gemm), bits(_fused_logits(head, h)))


def _sampler_matches_fused(dtype, tied, *, implementation=None, entropy_bitwise=True,
                           logp_bitwise=True):
  """Sampler side (``head.logits`` then ``logp_from_logits`` of the argmax) against the
  fused head: logp and entropy bitwise, or (where the flag says so) within a relative
  1e-6; returns ``(head, h, z)``."""
  head = _head(dtype, tied)
  head.implementation = implementation
  h = wide_rows(jax.random.key(6), T, H, dtype, spread=3)
  z = head.logits(h, temperature=0.7)
  t = jnp.argmax(z, axis=-1)
  lp_s, ent_s = head.logp_from_logits(z, t, return_entropy=True)
  lp_f, ent_f = head(h, t, temperature=0.7, return_entropy=True)
  if logp_bitwise:
    assert_bitwise_equal(lp_s, lp_f, "sampler logp vs fused logp")
  else:
    assert rel_err(lp_s, lp_f) < 1e-6, rel_err(lp_s, lp_f)
  if entropy_bitwise:
    assert_bitwise_equal(ent_s, ent_f, "sampler entropy vs fused entropy")
  else:
    assert rel_err(ent_s, ent_f) < 1e-6, rel_err(ent_s, ent_f)
  # Control: a stock log_softmax of the very same logits reduces in another order.
  lp_x = jax.nn.log_softmax(z, axis=-1)[jnp.arange(T), t]
  assert not np.array_equal(bits(lp_x), bits(lp_f))
  assert float(jnp.max(jnp.abs(lp_x - lp_f))) < 1e-4
  return head, h, z




@pytest.mark.parametrize("implementation", ["interpret", "cpu"])
@pytest.mark.parametrize("dtype,tied", [(jnp.float32, True), (jnp.bfloat16, False)])
def test_argmax_logp_from_logits_equals_fused_bitwise(dtype, tied, implementation):
  _sampler_matches_fused(dtype, tied, implementation=implementation)


def _sampler_entropy_matches_fused(dtype, tied, implementation=None):
  """``head.logits(h, T, return_stats=True)``: the logits are ``head.logits(h, T)``'s, the
  entropy is the fused head's ``head(h, t, T, return_entropy=True)`` and
  ``logp_from_stats`` its log-probs, bitwise."""
  head = _head(dtype, tied)
  head.implementation = implementation
  h = wide_rows(jax.random.key(7), T, H, dtype, spread=3)
  z, stats = head.logits(h, temperature=0.7, return_stats=True)
  assert_bitwise_equal(z, head.logits(h, temperature=0.7), "logits with vs without stats")
  t = jnp.argmax(z, axis=-1)
  lp_f, ent_f = head(h, t, temperature=0.7, return_entropy=True)
  assert_bitwise_equal(stats.entropy, ent_f, "sampler entropy vs fused entropy")
  assert_bitwise_equal(logp_from_stats(z, stats, t), lp_f, "sampler logp vs fused logp")
  mask = jnp.arange(T) % 3 != 0
  assert_bitwise_equal(logp_from_stats(z, stats, t, mask), head(h, t, mask, temperature=0.7),
                       "masked sampler logp vs fused logp")
  # Values: lse and entropy of softmax(z) in float64.
  z64 = np.asarray(z, np.float64)
  lse = np.log(np.sum(np.exp(z64 - z64.max(-1, keepdims=True)), -1)) + z64.max(-1)
  p64 = np.exp(z64 - lse[:, None])
  ent = lse - np.sum(p64 * z64, -1)
  assert np.max(np.abs(np.asarray(stats.lse, np.float64) - lse)) < 1e-5 * np.abs(lse).max()
  assert np.max(np.abs(np.asarray(stats.entropy, np.float64) - ent)) < 1e-4 * max(1.0, ent.max())


@pytest.mark.parametrize("implementation", [None, "interpret"])
@pytest.mark.parametrize("dtype,tied", [(jnp.float32, True), (jnp.bfloat16, False)])
def test_sampler_entropy_equals_fused_bitwise(dtype, tied, implementation):
  _sampler_entropy_matches_fused(dtype, tied, implementation)


@pytest.mark.gpu
def test_argmax_logp_from_logits_equals_fused_bitwise_gpu():
  _sampler_matches_fused(jnp.bfloat16, True, entropy_bitwise=False)
  test_logits_are_the_fused_projection_bitwise(jnp.bfloat16, True, False)


@pytest.mark.gpu
def test_sampler_entropy_equals_fused_bitwise_gpu():
  """On Hopper bf16 the default is "mosaic": the entropy comes out of the logits kernel."""
  _sampler_entropy_matches_fused(jnp.bfloat16, True)


@pytest.mark.hopper
@pytest.mark.parametrize("tied", [True, False])
def test_argmax_logp_from_logits_equals_fused_bitwise_mosaic_gpu(tied):
  """Hopper, implementation="mosaic": the logits are the fused Mosaic kernel's own
  accumulator (a store epilogue) and logits_logp reduces them in its wgmma register
  layout with its tile_epilogue code, so the sampler's logp is the trainer's bitwise."""
  _mosaic_sampler_matches_fused(tied, entropy_bitwise=False)


@pytest.mark.gpu
@pytest.mark.parametrize("tied", [True, False])
def test_logp_from_logits_close_to_fused_triton_gpu(tied):
  """implementation="triton" on a GPU: logits -> logits_logp is within a relative 1e-6 of
  the fused head, not bitwise (H100: 2 of 37 rows differed in the last bit: Triton compiles
  the from-logits reduction to another instruction sequence than the fused epilogue). The
  bitwise sampler path is head.logits(..., return_stats=True) + logp_from_stats, tested in
  test_sampler_entropy_equals_fused_bitwise_impl_gpu."""
  _sampler_matches_fused(jnp.bfloat16, tied, implementation="triton", entropy_bitwise=False,
                         logp_bitwise=False)


def _mosaic_sampler_matches_fused(tied, *, entropy_bitwise):
  head, h, z = _sampler_matches_fused(jnp.bfloat16, tied, implementation="mosaic",
                                      entropy_bitwise=entropy_bitwise)
  w, layout = _weight(head)
  hr = jnp.repeat(h, V, axis=0)
  tg = jnp.tile(jnp.arange(V, dtype=jnp.int32), T)
  _, _, _, tz = tile_partials(hr, w, head.bias_value(), tg, weight_layout=layout,
                              temperature=0.7, implementation="mosaic")
  assert_bitwise_equal(z, tz.reshape(T, V), "logits vs fused z")


def test_logits_gradients_vs_float64():
  head = _head(jnp.float32, False)
  h = jax.random.normal(jax.random.key(8), (5, H))
  g = jax.random.normal(jax.random.key(9), (5, V))

  def f(head, h):
    return jnp.sum(head.logits(h, temperature=2.0) * g)

  gm, gh = nnx.grad(f, argnums=(0, 1))(head, h)
  w = np.asarray(head.kernel[...], np.float64)
  g64 = np.asarray(g, np.float64) / 2.0
  assert rel_err(gh, g64 @ w.T) <= TOL["float32"][1]
  assert rel_err(gm.kernel[...], np.asarray(h, np.float64).T @ g64) <= TOL["float32"][1]
  assert rel_err(gm.bias[...], g64.sum(0)) <= TOL["float32"][1]


def test_fp32_head_gradient_reaches_bf16_parameter():
  h = jax.random.normal(jax.random.key(10), (2, 7, H))  # a float32 residual stream
  t = jax.random.randint(jax.random.key(11), (2, 7), 0, V)
  heads = {f: _head(jnp.bfloat16, False, fp32_head=f) for f in (True, False)}
  w = heads[True].kernel[...]
  ref = linear_logp_reference(h, w, t, bias=heads[True].bias[...], g_logp=np.ones((2, 7)))
  # fp32_head: the float32 hidden is used as is -> float32 accuracy on bf16 weights.
  assert rel_err(heads[True](h, t), ref["logp"]) <= TOL["float32"][0]
  # Without it the hidden is rounded to bf16 first: a different (coarser) path.
  assert rel_err(heads[False](h, t), ref["logp"]) > 10 * TOL["float32"][0]

  grads = nnx.grad(lambda m: jnp.sum(m(h, t)))(heads[True])
  dw = grads.kernel[...]
  assert dw.dtype == jnp.bfloat16 and grads.bias[...].dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(dw, np.float32))) and float(jnp.abs(dw).max()) > 0
  assert rel_err(dw, ref["dw"]) <= TOL["bfloat16"][1]
  assert rel_err(grads.bias[...], ref["db"]) <= TOL["bfloat16"][1]


# ----------------------------------------------------------------------------- TinyCausalLM

LENS = (13, 29, 7)  # unequal lengths: right padding differs per row


@pytest.fixture(scope="module")
def lm():
  return TinyCausalLM(TinyLMConfig.preset("test"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def lm_batch():
  rng = np.random.default_rng(0)
  tmax = max(LENS) + 3
  toks = rng.integers(0, 64, (3, tmax)).astype(np.int32)
  tg = rng.integers(0, 64, (3, tmax)).astype(np.int32)
  mask = np.arange(tmax)[None] < np.array(LENS)[:, None]
  return toks, tg, mask


def test_tiny_lm_logp_batch_and_padding_invariant_bitwise(lm, lm_batch):
  toks, tg, mask = lm_batch
  f = nnx.jit(lambda m, a, b, c: m.logp(a, b, c))
  full = np.asarray(f(lm, toks, tg, mask))
  assert np.all(full[~mask] == 0) and np.all(np.isfinite(full))
  for r, n in enumerate(LENS):
    alone = f(lm, toks[r:r + 1, :n], tg[r:r + 1, :n], mask[r:r + 1, :n])
    assert_bitwise_equal(alone[0], full[r, :n], f"row {r}: batch of 1 (length {n}) vs batch of 3")
  # The same row surrounded by other rows in a different order.
  perm = f(lm, toks[::-1], tg[::-1], mask[::-1])
  assert_bitwise_equal(perm[::-1], full, "rows permuted")


def test_tiny_lm_values_and_segments(lm, lm_batch):
  toks, tg, _ = lm_batch
  # Jitted: one compilation per shape instead of one per primitive.
  hidden = nnx.jit(lambda m, t: m(t))
  h = hidden(lm, toks[:1, :10])
  ref = linear_logp_reference(h, lm.embed.embedding[...], tg[:1, :10], weight_layout="vh")
  logp = nnx.jit(lambda m, t, tg: m.logp(t, tg))(lm, toks[:1, :10], tg[:1, :10])
  assert rel_err(logp, ref["logp"]) <= TOL["float32"][0]
  # Two documents packed in one row (positions restart, segments split) give
  # each document's own hidden states.
  packed = np.concatenate([toks[0, :6], toks[1, :4]])[None]
  pos = np.concatenate([np.arange(6), np.arange(4)])[None]
  seg = np.array([[1] * 6 + [2] * 4])
  hp = nnx.jit(lambda m, t, pos, seg: m(t, pos, seg, max_docs=2))(lm, packed, pos, seg)
  assert rel_err(hp[0, 6:], hidden(lm, toks[1:2, :4])[0]) <= TOL["float32"][0]
  assert rel_err(hp[0, :6], hidden(lm, toks[:1, :6])[0]) <= TOL["float32"][0]


def test_tiny_lm_gradients_finite_and_tied(lm, lm_batch):
  toks, tg, mask = lm_batch
  assert lm.head.kernel is None  # tied: one embedding parameter
  grads = nnx.jit(nnx.grad(lambda m: -jnp.sum(m.logp(toks, tg, mask))))(lm)
  leaves = jax.tree.leaves(grads)
  assert leaves and all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)
  assert all(float(jnp.abs(x).max()) > 0 for x in leaves)


def test_tiny_lm_config_errors():
  with pytest.raises(ValueError, match="heads of even size"):
    TinyLMConfig(hidden=30, num_heads=4)
  with pytest.raises(ValueError, match="preset"):
    TinyLMConfig.preset("huge")


@pytest.mark.gpu
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("implementation", [pytest.param("mosaic", marks=pytest.mark.hopper),
                                            "triton"])
def test_sampler_entropy_equals_fused_bitwise_impl_gpu(implementation, tied):
  _sampler_entropy_matches_fused(jnp.bfloat16, tied, implementation=implementation)


@pytest.mark.parametrize("impl", ["cpu", "interpret"])
def test_head_partials_merged_later_give_the_stats_bitwise(impl):
  """``head_logits_partials`` of two calls, stacked along a row axis and merged once, give
  each call's ``head_logits(..., return_stats=True)`` statistics bitwise."""
  from jaxrl_kernels.linear_logp.logits import (
      head_logits,
      head_logits_partials,
      merge_logit_partials,
  )
  w = (jax.random.normal(jax.random.key(1), (64, 1000)) * 0.3).astype(jnp.bfloat16)
  hs = [jax.random.normal(jax.random.key(k), (3, 4, 64)).astype(jnp.bfloat16) for k in (2, 3)]
  stats, parts = [], []
  for h in hs:
    z, st = head_logits(h, w, return_stats=True, temperature=0.8, implementation=impl)
    z2, p = head_logits_partials(h, w, temperature=0.8, implementation=impl)
    assert_bitwise_equal(z2, z, "logits")
    assert p.m.shape == (8, 3, 4)
    stats.append(st)
    parts.append(p)
  both = type(parts[0])(*(jnp.stack(x, axis=1) for x in zip(*parts, strict=True)))
  merged = merge_logit_partials(both, implementation=impl)
  for k, st in enumerate(stats):
    assert_bitwise_equal(merged.lse[k], st.lse, f"lse of call {k}")
    assert_bitwise_equal(merged.entropy[k], st.entropy, f"entropy of call {k}")
  with pytest.raises(ValueError, match="implementation='xla' has no per-tile statistics"):
    head_logits_partials(hs[0], w, implementation="xla")
  with pytest.raises(TypeError, match="partials.m must be float32"):
    merge_logit_partials(type(both)(both.m.astype(jnp.bfloat16), both.s, both.u))
