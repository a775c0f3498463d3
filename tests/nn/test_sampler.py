"""The sampler's options (top-k, top-p, stop ids) and their determinism; the sampled
tokens' log-probs stay bitwise the trainer's with every option."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_bitwise_equal

from jaxrl_kernels.nn.sampler import draw, fixed_order_cumsum, sample, score
from jaxrl_kernels.nn.tiny_lm import TinyCausalLM, TinyLMConfig

_draw_jit = jax.jit(draw, static_argnames=("top_k", "top_p"))


def _draws(logits, n, **kw):
  """``n`` draws for one row of logits (one row per key, the same logits)."""
  z = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
  return np.asarray(_draw_jit(jax.random.key(0), z, **kw))


def test_fixed_order_cumsum_rows_and_values():
  rng = np.random.default_rng(0)
  x = (rng.random((9, 300)) * np.exp2(rng.integers(-12, 12, (9, 300)))).astype(np.float32)
  full = np.asarray(jax.jit(fixed_order_cumsum)(x))
  np.testing.assert_allclose(full, np.cumsum(x.astype(np.float64), -1), rtol=1e-5)
  for r in (0, 4, 8):  # a row's bits do not depend on the rows around it
    assert_bitwise_equal(np.asarray(jax.jit(fixed_order_cumsum)(x[r:r + 1]))[0], full[r],
                         f"row {r}")


def test_top_k_support():
  logits = np.array([0.1, 3.0, -1.0, 2.5, 2.9, 0.0, 2.9], np.float32)
  got = _draws(logits, 4000, top_k=3, top_p=None)
  assert set(got.tolist()) == {1, 4, 6}  # the 3 largest (ties at 2.9 both in)
  assert set(_draws(logits, 500, top_k=1, top_p=None).tolist()) == {1}  # greedy
  # Without truncation every token appears.
  assert set(_draws(logits, 4000, top_k=None, top_p=None).tolist()) == set(range(7))


def test_top_p_nucleus():
  probs = np.array([0.05, 0.5, 0.15, 0.3], np.float64)
  logits = np.log(probs).astype(np.float32)
  # Sorted: 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95.
  got = _draws(logits, 6000, top_k=None, top_p=0.7)
  assert set(got.tolist()) == {1, 3}
  frac = np.mean(got == 1)
  assert abs(frac - 0.5 / 0.8) < 0.03  # renormalised over the nucleus
  assert set(_draws(logits, 6000, top_k=None, top_p=0.85).tolist()) == {1, 2, 3}
  assert set(_draws(logits, 500, top_k=None, top_p=0.2).tolist()) == {1}  # first always kept
  # top-k first, then top-p renormalised over the k: {0.5, 0.3} -> 0.625, 0.375.
  assert set(_draws(logits, 3000, top_k=2, top_p=0.6).tolist()) == {1}
  assert set(_draws(logits, 3000, top_k=2, top_p=0.65).tolist()) == {1, 3}


def test_draw_deterministic_given_key():
  z = jax.random.normal(jax.random.key(1), (6, 50))
  for kw in (dict(top_k=None, top_p=None), dict(top_k=7, top_p=None),
             dict(top_k=None, top_p=0.9), dict(top_k=10, top_p=0.5)):
    a = _draw_jit(jax.random.key(5), z, **kw)
    b = _draw_jit(jax.random.key(5), z, **kw)
    assert_bitwise_equal(np.asarray(b), np.asarray(a), str(kw))


# ------------------------------------------------------------------- on a model


@pytest.fixture(scope="module")
def lm():
  return TinyCausalLM(TinyLMConfig.preset("test"), rngs=nnx.Rngs(0))


PROMPTS = np.random.default_rng(2).integers(0, 64, (4, 6)).astype(np.int32)
LENS = np.array([6, 2, 4, 1], np.int32)


def test_truncated_sampling_logp_equals_score_bitwise(lm):
  res = sample(lm, PROMPTS, LENS, max_new_tokens=7, key=jax.random.key(4), temperature=0.9,
               top_k=8, top_p=0.85, stop_ids=(3, 11))
  tok, m, lp = (np.asarray(x) for x in (res.tokens, res.completion_mask, res.logp))
  assert np.all(lp[m] < 0) and np.all(lp[~m] == 0)
  for b, n in enumerate(LENS):  # a row ends at its first stop id or after 7 tokens
    comp = tok[b, n:n + m[b].sum()]
    assert np.isin(comp, (3, 11)).sum() <= 1 and (m[b].sum() == 7 or comp[-1] in (3, 11))
    assert not tok[b, n + m[b].sum():].any()
  for kw in (dict(), dict(batch_size=3, pack=True)):
    got = score(lm, res.tokens, res.completion_mask, temperature=0.9, **kw)
    assert_bitwise_equal(got, lp, f"score({kw}) vs sampler")


def test_greedy_and_early_stop(lm):
  a = sample(lm, PROMPTS, LENS, max_new_tokens=5, key=jax.random.key(0), top_k=1)
  b = sample(lm, PROMPTS, LENS, max_new_tokens=5, key=jax.random.key(9), top_k=1)
  assert_bitwise_equal(np.asarray(b.tokens), np.asarray(a.tokens), "greedy ignores the key")
  # Greedy = the argmax of the head's logits at the sampled position.
  tok = np.asarray(a.tokens)
  h = nnx.jit(lambda m, t: m.head.logits(m(t)))(lm, jnp.asarray(tok))
  for r, n in enumerate(LENS):
    np.testing.assert_array_equal(np.argmax(np.asarray(h)[r, n - 1:n + 4], -1), tok[r, n:n + 5])
  # Every row's first greedy token is a stop id: one token each, and the loop ends early.
  first = sorted({int(tok[r, n]) for r, n in enumerate(LENS)})
  stop = sample(lm, PROMPTS, LENS, max_new_tokens=5, key=jax.random.key(0), top_k=1,
                stop_ids=first)
  np.testing.assert_array_equal(np.asarray(stop.completion_mask).sum(1), 1)
  np.testing.assert_array_equal(np.asarray(stop.lengths), LENS + 1)
  np.testing.assert_array_equal(np.asarray(stop.logp)[np.asarray(stop.completion_mask)],
                                np.asarray(a.logp)[np.arange(4), LENS])


def test_steps_per_chunk_changes_no_bit(lm):
  """Chunks of 1, 4 and 32 steps (the merge of the head statistics per chunk, a tail of
  fewer steps, rows stopping mid-chunk): the same tokens and log-probs, the trainer's."""
  kw = dict(max_new_tokens=11, key=jax.random.key(6), temperature=1.1)
  plain = np.asarray(sample(lm, PROMPTS, LENS, **kw).tokens)
  # Stop ids sampled mid-run by two rows: those rows end inside a chunk.
  kw["stop_ids"] = (int(plain[0, LENS[0] + 4]), int(plain[2, LENS[2] + 7]))
  runs = {c: sample(lm, PROMPTS, LENS, steps_per_chunk=c, **kw) for c in (1, 4, 32)}
  ref = runs[1]
  m = np.asarray(ref.completion_mask)
  assert 0 < m.sum() < 4 * 11, "the stop ids should end some rows early"
  for c, res in runs.items():
    for name in ("tokens", "completion_mask", "lengths"):
      np.testing.assert_array_equal(np.asarray(getattr(res, name)),
                                    np.asarray(getattr(ref, name)), f"steps_per_chunk={c}")
    assert_bitwise_equal(np.asarray(res.logp), np.asarray(ref.logp), f"steps_per_chunk={c}")
  got = score(lm, ref.tokens, ref.completion_mask, temperature=1.1)
  assert_bitwise_equal(got, np.asarray(ref.logp), "score vs sampler")


def test_the_draw_in_the_head_and_from_the_logits(lm):
  """``fused_draw`` (the race in the head's pass, the default) and ``fused_draw=False``
  (``jax.random.categorical`` on the stored logits): each reports the trainer's log-probs
  bitwise, each is deterministic given the key, and they draw other tokens for one key.
  With top-k the draw is from the logits either way (the same tokens)."""
  kw = dict(max_new_tokens=9, key=jax.random.key(3), temperature=0.8)
  fused = sample(lm, PROMPTS, LENS, **kw)
  again = sample(lm, PROMPTS, LENS, **kw)
  plain = sample(lm, PROMPTS, LENS, fused_draw=False, **kw)
  assert_bitwise_equal(np.asarray(again.tokens), np.asarray(fused.tokens), "same key")
  assert not np.array_equal(np.asarray(plain.tokens), np.asarray(fused.tokens))
  for res in (fused, plain):
    got = score(lm, res.tokens, res.completion_mask, temperature=0.8)
    assert_bitwise_equal(got, np.asarray(res.logp), "score vs sampler")
  top = [sample(lm, PROMPTS, LENS, top_k=5, fused_draw=f, **kw).tokens for f in (True, False)]
  assert_bitwise_equal(np.asarray(top[0]), np.asarray(top[1]), "top-k draws from the logits")


def test_every_row_stopping_ends_the_loop_at_a_chunk(lm):
  a = sample(lm, PROMPTS, LENS, max_new_tokens=9, key=jax.random.key(0), top_k=1)
  first = sorted({int(np.asarray(a.tokens)[r, n]) for r, n in enumerate(LENS)})
  for c in (2, 3):
    stop = sample(lm, PROMPTS, LENS, max_new_tokens=9, key=jax.random.key(0), top_k=1,
                  stop_ids=first, steps_per_chunk=c)
    np.testing.assert_array_equal(np.asarray(stop.completion_mask).sum(1), 1)
    np.testing.assert_array_equal(np.asarray(stop.logp)[np.asarray(stop.completion_mask)],
                                  np.asarray(a.logp)[np.arange(4), LENS])


def test_a_group_prefills_its_prompt_once_with_the_bits_of_repeated_rows(lm, monkeypatch):
  """num_samples=G: each prompt prefilled once, its cache shared by its G completions; the
  tokens, masks and log-probs are bitwise those of sampling the G-times repeated prompts,
  and the log-probs the trainer's. The prefill runs on B rows, not B G."""
  g = 3
  kw = dict(max_new_tokens=6, key=jax.random.key(8), temperature=0.8, stop_ids=(5,))
  group = sample(lm, PROMPTS, LENS, num_samples=g, **kw)
  rep = sample(lm, np.repeat(PROMPTS, g, 0), np.repeat(LENS, g), **kw)
  for name in ("tokens", "completion_mask", "lengths"):
    np.testing.assert_array_equal(np.asarray(getattr(group, name)),
                                  np.asarray(getattr(rep, name)), name)
  assert_bitwise_equal(np.asarray(group.logp), np.asarray(rep.logp), "logp")
  tok = np.asarray(group.tokens)
  assert any(not np.array_equal(tok[i * g], tok[i * g + 1]) for i in range(4)), \
      "a group's completions should differ (distinct draws per row)"
  got = score(lm, group.tokens, group.completion_mask, temperature=0.8)
  assert_bitwise_equal(got, np.asarray(group.logp), "score vs grouped sampler")
  # The prefill's batch: B rows (traced shapes of the jitted program).
  seen = []
  original = TinyCausalLM.prefill

  def spy(self, tokens, lengths, cache):
    seen.append(tokens.shape[0])
    return original(self, tokens, lengths, cache)

  monkeypatch.setattr(TinyCausalLM, "prefill", spy)
  sample(lm, PROMPTS, LENS, num_samples=g, max_new_tokens=2, key=jax.random.key(1))
  assert seen == [4], seen


def _first_end(comp: np.ndarray, seqs) -> int | None:
  """The length of the shortest prefix of ``comp`` ending with one of ``seqs`` (numpy)."""
  for t in range(1, len(comp) + 1):
    if any(t >= len(q) and list(comp[t - len(q):t]) == list(q) for q in seqs):
      return t
  return None


def test_stop_sequences_per_row_keep_the_bits(lm):
  """Multi-token stop sequences, per prompt: each row ends at the first completion of one of
  its own sequences (a numpy search of the unstopped run's tokens), the kept tokens and
  log-probs are bitwise the unstopped run's (the trainer's too), later positions are
  0 / masked / logp 0; rows without a match and rows given no sequence run to the end. A
  sequence only matches completion tokens, never the prompt's end."""
  n = 10
  kw = dict(max_new_tokens=n, key=jax.random.key(11), temperature=1.0)
  free = sample(lm, PROMPTS, LENS, **kw)
  tok = np.asarray(free.tokens)
  comp = [tok[r, LENS[r]:LENS[r] + n] for r in range(4)]
  per_row = [
      [comp[0][3:5].tolist(), [63, 63, 63]],       # a 2-token sequence completed at token 5
      [comp[1][6:7].tolist()],                     # a one-token per-row stop id
      [],                                          # no sequence: runs to the end
      [[int(PROMPTS[3, 0]), int(comp[3][0])]],     # straddles the prompt: no stop there
  ]
  res = sample(lm, PROMPTS, LENS, stop_sequences=per_row, **kw)
  m = np.asarray(res.completion_mask)
  for r in range(4):
    end = _first_end(comp[r], per_row[r]) or n
    assert m[r].sum() == end, (r, m[r].sum(), end)
    sl = slice(LENS[r], LENS[r] + end)
    np.testing.assert_array_equal(np.asarray(res.tokens)[r, sl], tok[r, sl])
    assert_bitwise_equal(np.asarray(res.logp)[r, sl], np.asarray(free.logp)[r, sl], f"row {r}")
    assert not np.asarray(res.tokens)[r, LENS[r] + end:].any()
    assert not np.asarray(res.logp)[r, LENS[r] + end:].any()
  assert m[0].sum() <= 5 and m[1].sum() <= 7 and m[2].sum() == n
  none = sample(lm, PROMPTS, LENS, stop_sequences=[[], [], [], []], **kw)  # no prompt has one
  assert_bitwise_equal(np.asarray(none.logp), np.asarray(free.logp), "B empty lists")
  got = score(lm, res.tokens, res.completion_mask, temperature=1.0)
  assert_bitwise_equal(got, np.asarray(res.logp), "score vs sampler")
  # The same table as a padded array (-1 on the left), and shared sequences as [S, L].
  table = -np.ones((4, 2, 3), np.int32)
  for r, row in enumerate(per_row):
    for j, q in enumerate(row):
      table[r, j, 3 - len(q):] = q
  again = sample(lm, PROMPTS, LENS, stop_sequences=table, **kw)
  np.testing.assert_array_equal(np.asarray(again.completion_mask), m)
  assert_bitwise_equal(np.asarray(again.logp), np.asarray(res.logp), "array form")
  # Every row's sequences as one [S, L] array (the same [4, 2, 3] table: no recompile).
  shared = [comp[0][3:5].tolist()]
  both = sample(lm, PROMPTS, LENS, stop_sequences=np.array([[-1, -1, -1], [-1, *shared[0]]],
                                                            np.int32), **kw)
  for r in range(4):
    assert np.asarray(both.completion_mask)[r].sum() == (_first_end(comp[r], shared) or n)


def test_stop_sequences_in_groups_follow_their_prompt(lm, caplog):
  """With num_samples, a prompt's sequences serve its G rows: bitwise the repeated call, and
  rows do stop early. Another table of the same shape compiles nothing (an operand)."""
  kw = dict(max_new_tokens=8, key=jax.random.key(2), temperature=0.9)
  free = sample(lm, PROMPTS, LENS, num_samples=2, **kw)
  tok = np.asarray(free.tokens)
  # Each prompt's first row's 3rd completion token; prompt 2 gets none.
  per_row = [[[int(tok[2 * i, LENS[i] + 2])]] if i != 2 else [] for i in range(4)]
  group = sample(lm, PROMPTS, LENS, num_samples=2, stop_sequences=per_row, **kw)
  rep = sample(lm, np.repeat(PROMPTS, 2, 0), np.repeat(LENS, 2),
               stop_sequences=[q for q in per_row for _ in range(2)], **kw)
  m = np.asarray(group.completion_mask)
  np.testing.assert_array_equal(np.asarray(rep.completion_mask), m)
  assert_bitwise_equal(np.asarray(group.logp), np.asarray(rep.logp), "grouped stop sequences")
  assert all(m[2 * i].sum() <= 3 for i in (0, 1, 3)) and m[4].sum() == m[5].sum() == 8
  assert_bitwise_equal(np.asarray(group.logp)[m], np.asarray(free.logp)[m], "kept bits")
  other = [[[int(tok[2 * i + 1, LENS[i] + 1])]] if i != 2 else [[0]] for i in range(4)]
  with caplog.at_level("WARNING"), jax.log_compiles(True):
    sample(lm, PROMPTS, LENS, num_samples=2, stop_sequences=other, **kw)
  assert not [r for r in caplog.records if "_generate" in r.getMessage()], \
      "a new table of the same shape recompiled the sampler"


@pytest.mark.parametrize("kw, match", [
    (dict(steps_per_chunk=0), "steps_per_chunk must be an int >= 1"),
    (dict(top_k=0), "top_k must be None or an int in \\[1, 64\\]"),
    (dict(top_k=65), "top_k must be None or an int in \\[1, 64\\]"),
    (dict(top_k=True), "top_k"),
    (dict(top_p=0.0), "top_p must be None or a float in \\(0, 1\\]"),
    (dict(top_p=1.5), "top_p"),
    (dict(stop_ids=(64,)), "stop_ids must hold ints in \\[0, 64\\)"),
    (dict(stop_ids=(1.0,)), "stop_ids"),
    (dict(eos_id=-1), "eos_id must hold ints"),
    (dict(temperature=True), "temperature"),
    (dict(fused_draw=1), "fused_draw must be a bool"),
    (dict(num_samples=0), "num_samples must be an int >= 1"),
    (dict(num_samples=2.0), "num_samples"),
    (dict(stop_sequences=[[64]]), "stop_sequences\\[0\\] must be a non-empty sequence of ints in "
                                  "\\[0, 64\\)"),
    (dict(stop_sequences=[[1], []]), "stop_sequences\\[1\\] must be a non-empty"),
    (dict(stop_sequences=[[[1]], [[2]]]), "per prompt must hold 4 lists"),
    (dict(stop_sequences=[[[1]], [], [[-2]], []]), "stop_sequences\\[2\\]\\[0\\]"),
    (dict(stop_sequences="</s>"), "token id sequences, got a string"),
    (dict(stop_sequences=np.zeros((3, 2, 2), np.int32)), "\\[B=4, S, L\\]"),
    (dict(stop_sequences=np.full((1, 2), 64, np.int32)), "stop_sequences must lie in"),
    (dict(stop_sequences=np.array([[5, 7, -1]], np.int32)), "-1 pads on the left only"),
    (dict(stop_sequences=np.array([[2 ** 32 + 5]], np.int64)), "stop_sequences"),
    (dict(stop_sequences=np.array([[1.0]])), "integer dtype"),
])
def test_bad_options(lm, kw, match):
  with pytest.raises((ValueError, TypeError), match=match):  # TypeError: a bool temperature
    sample(lm, PROMPTS, LENS, max_new_tokens=2, key=jax.random.key(0), **kw)


def test_score_tp_mesh_needs_an_lm_head(lm):
  """score's tp_mesh splits an LMHead; a model with another head (a sharded model runs its
  own head vocab-parallel) is refused before anything runs."""

  class OtherHead:
    pass

  class Wrapped:
    config = lm.config
    head = OtherHead()

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
  tokens = np.zeros((1, 4), np.int32)
  cm = np.array([[False, True, True, True]])
  with pytest.raises(ValueError, match="tp_mesh takes a model with an LMHead; .* OtherHead"):
    score(Wrapped(), tokens, cm, tp_mesh=mesh)
