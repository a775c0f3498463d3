"""The sampler's draw (``pallas.draw``): its noise words, that the race draws from the
softmax, that the head's draw reports the trainer's log-prob, and that Hopper's draw runs in
the LM head's kernel with no logits in memory (lowered for CUDA here; its bits against the
stored-logits draw are tests/linear_logp/test_linear_logp_mosaic_gpu.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal

from jaxrl_kernels.linear_logp import linear_logp
from jaxrl_kernels.linear_logp.logits import head_draw_partials, head_logits, merge_logit_partials
from jaxrl_kernels.pallas import draw
from jaxrl_kernels.pallas import softmax_partials as sp

SEED = draw.seed_words(jax.random.key(0))


def _uniforms(seed, rows, cols):
  k1, k2 = draw.row_keys(seed, jnp.arange(rows))
  words = draw.noise_bits(k1[:, None], k2[:, None], jnp.arange(cols)[None, :])
  return np.asarray(words).view(np.uint32)


def test_noise_words_are_uniform_distinct_and_uncorrelated():
  """Top-23-bit uniforms over 2048 rows x 1024 columns: mean, variance and the
  Kolmogorov-Smirnov distance within 5 sigma of U(0, 1); neighbouring columns, rows and
  steps (seeds of fold_in(key, 0) and (key, 1)) uncorrelated within 5 sigma; every word in
  a row distinct. Control: the column index itself as the word fails the correlation bound."""
  words = _uniforms(SEED, 2048, 1024)
  u = ((words >> 9).astype(np.float64) + 0.5) / 2**23
  n = u.size
  assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
  assert abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / n)
  srt = np.sort(u.ravel())
  ks = np.max(np.abs(srt - (np.arange(1, n + 1) - 0.5) / n))
  assert ks * np.sqrt(n) < 2.0  # p ~ 7e-4 for a true uniform
  bound = 5 / np.sqrt(n)

  def corr(a, b):
    return abs(np.corrcoef(a.ravel(), b.ravel())[0, 1])

  assert corr(u[:, :-1], u[:, 1:]) < bound
  assert corr(u[:-1], u[1:]) < bound
  other = _uniforms(draw.seed_words(jax.random.fold_in(jax.random.key(0), 1)), 2048, 1024)
  step0 = _uniforms(draw.seed_words(jax.random.fold_in(jax.random.key(0), 0)), 2048, 1024)
  assert corr(((other >> 9) + 0.5) / 2**23, ((step0 >> 9) + 0.5) / 2**23) < bound
  assert all(len(np.unique(r)) == r.size for r in words[:64])
  cols = np.broadcast_to(np.arange(1024.0), u.shape)
  assert corr(cols[:, :-1], cols[:, 1:]) > bound  # the control: a bad word is caught


def test_every_noise_word_gives_a_positive_finite_exponential():
  """The extreme words (all bits 0 or 1, and the 23 kept bits all 0 or all 1 under any
  low bits) give ``E`` in ``[5.96e-8, 16.7]``: ``u`` is never rounded to 0 or 1 (with 24
  kept bits, ``2^24 - 1/2`` rounds to ``2^24`` in float32: ``u = 1``, ``E = -0``, and a
  column with ``e = 0`` gets ``0 / -0`` = NaN, dropping its whole tile from the race).
  Between them, ``E`` decreases with the word, and ``-log`` of the float32 ``u`` matches
  float64 within 1e-6 relative."""
  words = np.array([0, 1, 0x1FF, 0x200, 0x7FFFFFFF, 0x80000000, 0xFFFFFE00, 0xFFFFFDFF,
                    0xFFFFFFFF], np.uint32)
  e = np.asarray(draw.exp_noise(jnp.asarray(words.view(np.int32))), np.float64)
  assert np.all(np.isfinite(e)) and np.all(e >= 5.9e-8) and np.all(e <= 16.7), e
  assert np.all(np.diff(e[np.argsort(words)]) <= 0)
  u64 = ((words >> 9).astype(np.float64) + 0.5) / 2**23
  np.testing.assert_allclose(e, -np.log(u64), rtol=1e-6)


def _softmax64(z):
  z = np.asarray(z, np.float64)
  e = np.exp(z - z.max())
  return e / e.sum()


def _chi2(counts, p):
  expected = counts.sum() * p
  return float(np.sum((counts - expected) ** 2 / expected))


# 99.99% quantiles of chi-square: 11 and 15 degrees of freedom.
CHI2_11, CHI2_15 = 35.7, 42.3


def test_the_race_draws_from_the_softmax():
  """120000 rows of the same 13 logits (one masked, -inf) over tiles of 4 columns (the
  merge across tiles included): the token counts fit softmax(z) (chi-square below its
  99.99% quantile), the masked column is never drawn and each token's logit is its z
  exactly. Control: the same counts against softmax(1.05 z) fail the bound."""
  z = jnp.array([2.0, -1.0, 0.5, 3.0, -jnp.inf, 1.0, 0.0, -2.5, 2.9, 1.5, -0.5, 0.25, 2.0],
                jnp.float32)
  t = 120_000
  tokens, logit = draw.draw_from_logits(jnp.broadcast_to(z, (t, z.size)), SEED, tile=4)
  tokens = np.asarray(tokens)
  counts = np.bincount(tokens, minlength=z.size).astype(np.float64)
  assert counts[4] == 0
  keep = np.arange(z.size) != 4
  p = _softmax64(z)[keep]
  assert _chi2(counts[keep], p) < CHI2_11
  assert_bitwise_equal(np.asarray(logit), np.asarray(z)[tokens], "token logits")
  p_hot = _softmax64(1.05 * np.asarray(z, np.float64))[keep]
  assert _chi2(counts[keep], p_hot) > CHI2_11


def test_neighbouring_rows_and_steps_draw_independently():
  """Pairs of draws over 4 logits, 200000 rows: (row r, row r + 1) of one step and (step 0,
  step 1) of one row fit the product of the softmax marginals (chi-square, 15 degrees of
  freedom, below its 99.99% quantile)."""
  z = jnp.array([0.3, -0.2, 0.9, 0.0], jnp.float32)
  p = _softmax64(z)
  t = 200_000
  zz = jnp.broadcast_to(z, (t, 4))
  a = np.asarray(draw.draw_from_logits(zz, SEED, tile=4)[0])
  pairs = np.bincount(4 * a[0::2] + a[1::2], minlength=16).astype(np.float64)
  assert _chi2(pairs, np.outer(p, p).ravel()) < CHI2_15
  b = np.asarray(draw.draw_from_logits(
      zz, draw.seed_words(jax.random.fold_in(jax.random.key(0), 1)), tile=4)[0])
  steps = np.bincount(4 * a + b, minlength=16).astype(np.float64)
  assert _chi2(steps, np.outer(p, p).ravel()) < CHI2_15


@pytest.mark.parametrize("implementation", ["interpret", "cpu"])
@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_head_draw_reports_the_trainers_logp(implementation, layout):
  """``head_draw_partials``: the drawn tokens are the stored-logits race of the same head's
  logits; merged statistics + the token's logit give ``linear_logp`` of the drawn tokens
  bitwise (temperature 0.7, a bias, V not a multiple of the tile); the first rows' draws
  are the same in a smaller batch (the noise is keyed by the row index, the logits are
  batch-invariant)."""
  t, h, v = 40, 64, 300
  x = jax.random.normal(jax.random.key(1), (t, h), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (h, v), jnp.float32) * 0.3
  w = w if layout == "hv" else w.T
  b = jax.random.normal(jax.random.key(3), (v,), jnp.float32)
  kw = dict(bias=b, temperature=0.7, weight_layout=layout, implementation=implementation)
  tokens, tz, parts = head_draw_partials(x, w, SEED, **kw)
  z = head_logits(x, w, **kw)
  want_tokens, want_tz = draw.draw_from_logits(z, SEED, tile=128)
  assert_bitwise_equal(tokens, want_tokens, "tokens")
  assert_bitwise_equal(tz, want_tz, "token logits")
  stats = merge_logit_partials(parts, implementation=implementation)
  logp, _ = sp.finalize(tz, stats.lse, stats.entropy, tokens, None, v)
  assert_bitwise_equal(logp, linear_logp(x, w, tokens, **kw), "logp")
  head5 = head_draw_partials(x[:5], w, SEED, **kw)
  assert_bitwise_equal(head5[0], tokens[:5], "tokens of a smaller batch")
  assert len(np.unique(np.asarray(tokens))) > 5  # not one token for every row


def test_no_rows_draw_nothing():
  """A call with no rows (``[0, H]``, ``[2, 0, H]``) gives tokens, token logits and logits
  of the rows' shape and float32 statistics ``[n_tiles, *lead]``, as the logits partials of
  no rows do."""
  from jaxrl_kernels.linear_logp.logits import head_logits_partials  # noqa: PLC0415
  w = jnp.ones((8, 300))
  for lead in ((0,), (2, 0)):
    x = jnp.ones((*lead, 8))
    tokens, tz, parts = head_draw_partials(x, w, SEED, implementation="cpu")
    z, lparts = head_logits_partials(x, w, implementation="cpu")
    assert tokens.shape == tz.shape == lead and tokens.dtype == jnp.int32
    assert z.shape == (*lead, 300)
    assert tz.dtype == z.dtype == jnp.float32
    for got, want in zip(parts, lparts, strict=True):
      assert got.shape == want.shape == (3, *lead)
      assert got.dtype == want.dtype == jnp.float32


def test_head_draw_refuses_what_it_cannot_draw():
  x, w = jnp.ones((2, 8)), jnp.ones((8, 5))
  with pytest.raises(ValueError, match="seed must be int32"):
    head_draw_partials(x, w, jnp.zeros((2,), jnp.uint32), implementation="interpret")
  with pytest.raises(ValueError, match="seed must be int32"):
    head_draw_partials(x, w, jnp.zeros((3,), jnp.int32), implementation="interpret")
  with pytest.raises(ValueError, match="implementation='xla' has no per-tile"):
    head_draw_partials(x, w, SEED, implementation="xla")


@pytest.mark.parametrize("t", [1, 64, 256])
def test_hopper_draw_keeps_no_logits_in_memory(t):
  """Lowered for CUDA (Mosaic), the draw at a Qwen2.5 head's shape is one ``lm_head_draw``
  kernel and no float32 ``[T, V]`` array exists in the module. Control: the logits path's
  module has one."""
  from jaxrl_kernels.pallas import linear_logp_mosaic as lm  # noqa: PLC0415

  s = jax.ShapeDtypeStruct
  v, h = 151936, 896
  args = (s((t, h), jnp.bfloat16), s((v, h), jnp.bfloat16), s((2,), jnp.int32))
  kw = dict(layout="vh", temperature=1.0, compute_dtype=jnp.bfloat16)
  fn = jax.jit(lambda x, w, seed: lm.logits_draw(x, w, None, seed, **kw))
  exported = jax.export.export(fn, platforms=["cuda"])(*args)
  module = exported.mlir_module()
  assert module.count("lm_head_draw") >= 1
  assert f"x{v}xf32" not in module
  assert [a.shape for a in exported.out_avals[:2]] == [(t,), (t,)]
  ctrl = jax.jit(lambda x, w: lm.logits(x, w, None, **kw, return_stats=True))
  assert f"x{v}xf32" in jax.export.export(ctrl, platforms=["cuda"])(*args[:2]).mlir_module()


def test_packed_draw_statistics_unpack_to_their_rows():
  """The Mosaic epilogue's packing of seven row statistics per 64-row chunk (``_pack``, in
  the kernel's 2-D store) and its reader ``_unpack``: each statistic of each row and tile
  comes back in place, for 128- and 64-row CTA tiles, rows cut short and tiles past the
  vocabulary dropped (plain arrays on the CPU; the kernel's own run is the GPU test)."""
  from jaxrl_kernels.pallas import linear_logp_mosaic as lm  # noqa: PLC0415

  for tm, t in ((128, 200), (64, 50)):
    blocks, n_pad, n_tiles = -(-t // tm), 6, 5
    pack_ids = jax.lax.broadcasted_iota(jnp.int32, (lm.EPI_ROWS, lm.DRAW_PACK), 1)
    want = np.arange(7 * n_pad * blocks * tm, dtype=np.float32).reshape(7, n_pad, blocks * tm)
    packed = np.zeros((n_pad, blocks * lm.EPI_ROWS, lm.DRAW_PACK), np.float32)
    for tile in range(n_pad):
      for blk in range(blocks):
        out = jnp.zeros((lm.EPI_ROWS, lm.DRAW_PACK), jnp.float32)
        for c in range(tm // lm.EPI_ROWS):
          rows = slice(blk * tm + c * lm.EPI_ROWS, blk * tm + (c + 1) * lm.EPI_ROWS)
          out = lm._pack(out, pack_ids, [jnp.asarray(want[q, tile, rows]) for q in range(7)], c)
        packed[tile, blk * lm.EPI_ROWS:(blk + 1) * lm.EPI_ROWS] = np.asarray(out)
    got = lm._unpack(jnp.asarray(packed), n_tiles, t, tm, count=7)
    for q in range(7):
      assert_bitwise_equal(got[q], want[q, :n_tiles, :t], f"statistic {q}, tm={tm}")


def test_a_masked_tile_is_never_drawn():
  """Logits masked to -inf over a whole tile (a -inf bias over 4 columns) and over single
  columns of another: 20000 rows never draw a masked column."""
  z = jnp.array([0.5, 1.0, -jnp.inf, 0.0] + [-jnp.inf] * 4 + [2.0, -1.0, 0.3, 0.1],
                jnp.float32)
  tokens = np.asarray(draw.draw_from_logits(jnp.broadcast_to(z, (20_000, 12)), SEED,
                                            tile=4)[0])
  assert set(np.unique(tokens)) == {0, 1, 3, 8, 9, 10, 11}


def test_nan_logits_draw_token_zero_with_a_nan_logp():
  """A row of NaN logits has no race winner: token 0 (a valid id), and its log-prob from
  the statistics is NaN, never a silent number."""
  z = jnp.array([[0.0, 1.0, 2.0, 3.0], [jnp.nan] * 4], jnp.float32)
  tokens, _ = draw.draw_from_logits(z, SEED, tile=2)
  assert np.asarray(tokens)[1] == 0
  x = jnp.array([[1.0, 0.0], [jnp.nan, 0.0]], jnp.float32)
  w = jnp.ones((2, 5), jnp.float32)
  tok, tz, parts = head_draw_partials(x, w, SEED, implementation="interpret")
  stats = merge_logit_partials(parts, implementation="interpret")
  logp, _ = sp.finalize(tz, stats.lse, stats.entropy, tok, None, 5)
  assert np.isfinite(np.asarray(logp)[0]) and np.isnan(np.asarray(logp)[1])
  assert int(np.asarray(tok)[1]) == 0


@pytest.mark.parametrize("implementation", ["interpret", "cpu"])
def test_head_draw_with_a_bias_masking_a_whole_tile(implementation):
  """A ``-inf`` bias over vocabulary tile 1 (ids 128-255) and a few single ids: no row draws
  a masked id, and the drawn tokens' log-probs (finite) are the trainer's bitwise."""
  t, h, v = 64, 32, 300
  x = jax.random.normal(jax.random.key(4), (t, h), jnp.float32)
  w = jax.random.normal(jax.random.key(5), (h, v), jnp.float32) * 0.2
  masked = np.zeros(v, bool)
  masked[128:256] = True
  masked[[0, 5, 299]] = True
  b = jnp.where(jnp.asarray(masked), -jnp.inf, 0.0)
  kw = dict(bias=b, implementation=implementation)
  tokens, tz, parts = head_draw_partials(x, w, SEED, **kw)
  tokens = np.asarray(tokens)
  assert not masked[tokens].any()
  stats = merge_logit_partials(parts, implementation=implementation)
  logp, _ = sp.finalize(tz, stats.lse, stats.entropy, jnp.asarray(tokens), None, v)
  assert np.all(np.isfinite(np.asarray(logp)))
  assert_bitwise_equal(logp, linear_logp(x, w, jnp.asarray(tokens), **kw), "logp")
