"""TinyCausalLM decode = prefill = training forward, bitwise; the KV-cache sampler vs ``score``.

A token's hidden state and log-prob must have the same bits whether the KV
cache decodes it one token at a time at one batch size, or the full-sequence
forward computes it at another batch size with other padding and packing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_bitwise_equal, bits

from jaxrl_kernels.attention import cpu as attention_cpu
from jaxrl_kernels.nn.sampler import sample, score
from jaxrl_kernels.nn.tiny_lm import TinyCausalLM, TinyLMConfig

V = 64  # the "test" preset
# Prompt lengths of the sampler's batch; the second row crosses two key tiles.
PROMPTS = (5, 19, 1)
NEW = 14


def _model(impl=None, dtype="float32"):
  return TinyCausalLM(TinyLMConfig.preset("test", implementation=impl, dtype=dtype),
                      rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def lm():
  return _model()


@pytest.fixture(scope="module")
def seqs():
  """Three sequences (prompt + continuation) of lengths PROMPTS + NEW, and the prompts."""
  rng = np.random.default_rng(1)
  return [rng.integers(0, V, n + NEW).astype(np.int32) for n in PROMPTS]


_fwd = nnx.jit(lambda m, t, p, s, *, max_docs: m(t, p, s, max_docs=max_docs),
               static_argnames="max_docs")
_fwd_plain = nnx.jit(lambda m, t: m(t))
_prefill = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c))
_decode = nnx.jit(lambda m, t, c: m.decode_step(t, c))


def _decode_hidden(model, seqs, order, cache_len=None):
  """Hidden state of every token of every sequence via prefill + one decode step per token,
  all sequences in one batch (in ``order``). Returns {seq: [n_tokens, H]} (from the
  last prompt token on)."""
  rows = [seqs[i] for i in order]
  p = max(PROMPTS)
  lens = np.array([PROMPTS[i] for i in order], np.int32)
  prompts = np.zeros((len(rows), p), np.int32)
  for r, s in enumerate(rows):
    prompts[r, :lens[r]] = s[:lens[r]]
  cache = model.init_cache(len(rows), cache_len or p + NEW)
  h, cache = _prefill(model, prompts, lens, cache)
  out = [np.asarray(h)]
  for i in range(NEW - 1):
    tok = np.array([s[n + i] for s, n in zip(rows, lens)], np.int32)
    h, cache = _decode(model, tok, cache)
    out.append(np.asarray(h))
  out = np.stack(out, 1)  # [B, NEW, H]: hidden of tokens lens-1 .. lens+NEW-2
  return {i: out[r] for r, i in enumerate(order)}


def _expected(hidden_of_seq, i):
  """Rows lens-1 .. lens+NEW-2 of a sequence's full hidden states."""
  n = PROMPTS[i]
  return hidden_of_seq[n - 1:n + NEW - 1]


@pytest.fixture(scope="module")
def alone(lm, seqs):
  """Reference: each sequence alone, batch of 1, no padding."""
  return [np.asarray(_fwd_plain(lm, s[None]))[0] for s in seqs]


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0)])
def test_decode_equals_forward_bitwise(lm, seqs, alone, order):
  dec = _decode_hidden(lm, seqs, order)
  for i in order:
    assert_bitwise_equal(dec[i], _expected(alone[i], i), f"seq {i}: KV decode (batch "
                         f"{len(order)}) vs forward (batch 1)")


def test_forward_layouts_bitwise(lm, seqs, alone):
  """Right padding in a bigger batch, left padding via positions, packing with segment ids,
  packing by restarting positions: every real token has the bits of its sequence alone."""
  lens = [len(s) for s in seqs]
  t = max(lens) + 5
  checks = []
  # Right padding, batch of 4 (one extra random row), rows permuted.
  right = np.random.default_rng(2).integers(0, V, (4, t)).astype(np.int32)
  for r, i in enumerate((2, 0, 1)):
    right[r + 1, :lens[i]] = seqs[i]
  h = np.asarray(_fwd_plain(lm, right))
  checks += [(h[r + 1, :lens[i]], i, "right padding") for r, i in enumerate((2, 0, 1))]
  # Left padding: positions = arange(T) - pads; pads get negative positions.
  left = np.zeros((3, t), np.int32)
  pos = np.zeros((3, t), np.int32)
  for i, s in enumerate(seqs):
    left[i, t - lens[i]:] = s
    pos[i] = np.arange(t) - (t - lens[i])
  h = np.asarray(_fwd(lm, left, pos, None, max_docs=3))
  checks += [(h[i, t - lens[i]:], i, "left padding") for i in range(3)]
  assert np.all(np.isfinite(h))
  # Packing: seq 0 and 2 in row 0 behind a pad, seq 1 in row 1; segment ids, then the
  # same without segment ids (the restarting positions alone split the documents).
  w = lens[0] + lens[2] + 2
  w = max(w, lens[1])
  pk, pp, ps = (np.zeros((2, w), np.int32) for _ in range(3))
  pp[:] = -1
  spans = [(0, 1, 0), (2, 1 + lens[0], 0), (1, 0, 1)]  # (seq, column, row)
  for j, (i, c, r) in enumerate(spans):
    pk[r, c:c + lens[i]] = seqs[i]
    pp[r, c:c + lens[i]] = np.arange(lens[i])
    ps[r, c:c + lens[i]] = j + 1
  for seg in (ps, None):
    h = np.asarray(_fwd(lm, pk, pp, seg, max_docs=4))
    checks += [(h[r, c:c + lens[i]], i, f"packed, segment_ids={seg is not None}")
               for i, c, r in spans]
  for got, i, what in checks:
    assert_bitwise_equal(got, alone[i], f"seq {i}: {what} vs alone")


def test_decode_with_other_key_tile_differs_control(lm, seqs, alone, monkeypatch):
  """The comparison can fail: a decode step whose attention tiles the keys differently
  (16 instead of KEY_TILE) changes the bits of a token that sees more than 16 keys."""
  monkeypatch.setattr(attention_cpu, "KEY_TILE", 16)
  dec = nnx.jit(lambda m, t, c: m.decode_step(t, c))  # traced with the patched tile
  p = max(PROMPTS)
  s = seqs[1]
  cache = lm.init_cache(1, p + NEW)
  h, cache = _prefill(lm, s[None, :p], np.array([p], np.int32), cache)
  h, cache = dec(lm, s[p:p + 1], cache)
  assert not np.array_equal(bits(np.asarray(h)[0]), bits(alone[1][p]))
  assert np.max(np.abs(np.asarray(h)[0] - alone[1][p])) < 1e-4


def test_bfloat16_decode_equals_forward_bitwise(seqs):
  model = _model(dtype="bfloat16")
  dec = _decode_hidden(model, seqs, (1, 0))
  for i in (1, 0):
    ref = np.asarray(_fwd_plain(model, seqs[i][None]))[0]
    assert dec[i].dtype == jnp.bfloat16
    assert_bitwise_equal(dec[i], _expected(ref, i), f"bf16 seq {i}: decode vs forward")


# ----------------------------------------------------------------------------- sampler


@pytest.fixture(scope="module")
def rollout(lm):
  rng = np.random.default_rng(3)
  prompts = rng.integers(0, V, (5, 8)).astype(np.int32)
  lens = np.array([8, 3, 1, 6, 5], np.int32)
  res = sample(lm, prompts, lens, max_new_tokens=9, key=jax.random.key(7), temperature=0.7)
  return prompts, lens, res


def test_sample_layout(rollout):
  prompts, lens, res = rollout
  tok, m, lp = (np.asarray(x) for x in (res.tokens, res.completion_mask, res.logp))
  assert tok.shape == m.shape == lp.shape == (5, 17) and lp.dtype == np.float32
  for b, n in enumerate(lens):
    np.testing.assert_array_equal(tok[b, :n], prompts[b, :n])
    assert m[b, n:n + 9].all() and m.sum(1)[b] == 9 and not tok[b, n + 9:].any()
  np.testing.assert_array_equal(np.asarray(res.lengths), lens + 9)
  assert np.all(lp[m] < 0) and np.all(lp[~m] == 0)


@pytest.mark.parametrize("kw", [dict(), dict(batch_size=2), dict(pack=True, batch_size=1)])
def test_sampler_logp_equals_score_bitwise(lm, rollout, kw):
  _, _, res = rollout
  got = score(lm, res.tokens, res.completion_mask, temperature=0.7, **kw)
  assert_bitwise_equal(got, res.logp, f"score({kw}) vs sampler logp")


def test_score_values_match_forward(lm, rollout):
  """score()[b, t] is log p(tokens[b, t] | tokens[b, :t]) at the temperature."""
  _, _, res = rollout
  tok = np.asarray(res.tokens)
  got = score(lm, tok, res.completion_mask, temperature=0.7)
  h = np.asarray(_fwd_plain(lm, tok[1:2]), np.float64)[0]
  z = h @ np.asarray(lm.embed.embedding[...], np.float64).T / 0.7
  lse = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
  n = int(res.lengths[1])
  ref = z[np.arange(n - 1), tok[1, 1:n]] - lse[:n - 1]
  m = np.asarray(res.completion_mask)[1, 1:n]
  np.testing.assert_allclose(got[1, 1:n][m], ref[m], rtol=1e-5, atol=1e-5)


def test_sampler_deterministic_and_eos(lm, rollout):
  prompts, lens, res = rollout
  again = sample(lm, prompts, lens, max_new_tokens=9, key=jax.random.key(7), temperature=0.7)
  for a, b in zip(res, again):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  other = sample(lm, prompts, lens, max_new_tokens=9, key=jax.random.key(8), temperature=0.7)
  assert not np.array_equal(np.asarray(other.tokens), np.asarray(res.tokens))
  # eos: the token the sampler picks first in row 0 stops that row at once.
  eos = int(np.asarray(res.tokens)[0, lens[0]])
  stop = sample(lm, prompts, lens, max_new_tokens=9, key=jax.random.key(7), temperature=0.7,
                eos_id=eos)
  tok, m = np.asarray(stop.tokens), np.asarray(stop.completion_mask)
  assert m[0].sum() == 1 and tok[0, lens[0]] == eos and not tok[0, lens[0] + 1:].any()
  for b, n in enumerate(lens):  # each row: completion ends at its first eos
    comp = tok[b, n:n + m[b].sum()]
    assert (comp == eos).sum() <= 1 and (m[b].sum() == 9 or comp[-1] == eos)
  np.testing.assert_array_equal(np.asarray(stop.lengths), lens + m.sum(1))
  assert_bitwise_equal(score(lm, tok, m, temperature=0.7, pack=True), stop.logp, "eos rows")


# ----------------------------------------------------------------------------- bad input


def test_cache_overflow_gives_nan_rows(lm):
  cache = lm.init_cache(2, 4)
  h, cache = _prefill(lm, np.array([[1, 2, 3, 4], [1, 2, 0, 0]], np.int32),
                      np.array([4, 2], np.int32), cache)
  h, cache2 = _decode(lm, np.array([5, 6], np.int32), cache)
  h = np.asarray(h)
  assert np.all(np.isnan(h[0])) and np.all(np.isfinite(h[1]))  # row 0 was full
  np.testing.assert_array_equal(np.asarray(cache2.lengths), [4, 3])
  assert_bitwise_equal(cache2.keys[0][0], cache.keys[0][0], "a full row writes nothing")


def test_bad_inputs(lm):
  with pytest.raises(ValueError, match="do not fit a cache of max_len=4"):
    lm.prefill(np.zeros((1, 5), np.int32), np.array([5]), lm.init_cache(1, 4))
  with pytest.raises(ValueError, match=r"lengths must lie in \[1, 3\]"):
    lm.prefill(np.zeros((1, 3), np.int32), np.array([0]), lm.init_cache(1, 4))
  with pytest.raises(ValueError, match=r"prompt_lengths must lie in \[1, 2\]"):
    sample(lm, np.zeros((2, 2), np.int32), np.array([1, 3]), max_new_tokens=2,
           key=jax.random.key(0))
  with pytest.raises(ValueError, match="max_new_tokens"):
    sample(lm, np.zeros((1, 2), np.int32), np.array([1]), max_new_tokens=0,
           key=jax.random.key(0))
  with pytest.raises(ValueError, match=r"completion_mask\[:, 0\] must be False"):
    score(lm, np.zeros((1, 3), np.int32), np.ones((1, 3), bool))
  toks = np.zeros((1, 6), np.int32)
  pos = np.array([[0, 1, 2, 0, 1, 2]])
  with pytest.raises(ValueError, match="2 documents but max_docs=1"):
    lm(toks, pos)
  with pytest.raises(ValueError, match="must start at position 0.*column 3 starts at "
                                       "position 5"):
    lm(toks, np.array([[0, 1, 2, 5, 6, 7]]), max_docs=2)
  # Under jit the same mistakes give NaN for the affected document only.
  h = np.asarray(_fwd(lm, toks, pos, None, max_docs=1))
  assert np.all(np.isfinite(h[0, :3])) and np.all(np.isnan(h[0, 3:]))


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_stock_path_drifts_and_kernels_do_not_gpu():
  """On the GPU the stock XLA path's trainer log-probs differ from its sampler's; with
  the kernels they are bitwise equal."""
  rng = np.random.default_rng(0)
  cfg = TinyLMConfig.preset("small")
  prompts = rng.integers(0, cfg.vocab_size, (16, 32)).astype(np.int32)
  lens = rng.integers(8, 33, 16).astype(np.int32)
  for impl in ("xla", None):
    model = TinyCausalLM(TinyLMConfig.preset("small", implementation=impl), rngs=nnx.Rngs(0))
    res = sample(model, prompts, lens, max_new_tokens=32, key=jax.random.key(0))
    got = score(model, res.tokens, res.completion_mask, batch_size=5, pack=True)
    same = np.array_equal(bits(got), bits(np.asarray(res.logp)))
    assert same == (impl is None), f"implementation={impl!r}: bitwise={same}"
