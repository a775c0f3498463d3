"""Property-based fuzz suite over the model / sampler / scorer surface.

``DecoderLM`` (its forward, ``logp``, ``prefill``, ``decode_step``), ``TinyCausalLM``,
``nn.sample`` and ``nn.score`` get token ids in and out of ``[0, V)`` (concrete and traced),
padding of any value after ``prompt_lengths`` / beyond ``completion_mask``, empty batches,
temperatures (valid, tiny, huge, NaN, traced) and eager vs ``jit`` calls, and each case
asserts one of:

* a named error (``ValueError``/``TypeError`` naming the argument);
* bitwise agreement: eager == jit, padding of any value == padding 0, sampler == scorer;
* a traced out-of-range id gives NaN (never a finite value) at every position that sees it.

Bounded for CI (``derandomize=True``, few examples, one tiny model per dtype so that the
compiled programs are reused). The module prints its counts at teardown (``pytest -s``).
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_bitwise_equal, fuzz
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh

from jaxrl_kernels import models
from jaxrl_kernels.linear_logp import linear_logp
from jaxrl_kernels.nn import TinyCausalLM, TinyLMConfig
from jaxrl_kernels.nn.sampler import sample, score

COUNTS: collections.Counter = collections.Counter()
V = 160  # not a multiple of the 128-wide vocab tile
B, P, N = 3, 5, 3


@pytest.fixture(scope="module", autouse=True)
def _counts():
  yield
  print(f"\nfuzz_models: {COUNTS['cases']} cases tried, {COUNTS['named']} named errors, "
        f"{COUNTS['agree']} bitwise agreements, {COUNTS['nan']} NaN propagations")


def case():
  COUNTS["cases"] += 1


def named(exc_type, match, fn, *args, **kwargs):
  with pytest.raises(exc_type, match=match):
    fn(*args, **kwargs)
  COUNTS["named"] += 1


def same_bits(a, b, what=""):
  assert_bitwise_equal(np.asarray(a), np.asarray(b), what)
  COUNTS["agree"] += 1


@functools.cache
def decoder(dtype: str) -> models.DecoderLM:
  cfg = models.from_hf_dict(dict(
      model_type="qwen2", vocab_size=V, hidden_size=64, intermediate_size=96,
      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
      hidden_act="silu", max_position_embeddings=64, rope_theta=1e6, tie_word_embeddings=True,
      torch_dtype="float32"))
  model = models.DecoderLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))
  # Wide-range embeddings (rows scaled by 2**-4 .. 2**4) so a reordering shows in the bits.
  emb = model.embed_tokens.embedding
  scale = 2.0 ** np.linspace(-4, 4, V)[:, None]
  emb.set_value((emb.get_value().astype(jnp.float32) * 40 * scale).astype(emb.get_value().dtype))
  return model


@functools.cache
def tiny() -> TinyCausalLM:
  return TinyCausalLM(TinyLMConfig(vocab_size=V, hidden=32, num_layers=1, num_heads=2,
                                   mlp_dim=64), rngs=nnx.Rngs(1))


def _prompts(seed: int) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  return rng.integers(0, V, (B, P)).astype(np.int32), np.array([P, 2, 4], np.int32)


_jit_logp = nnx.jit(lambda m, t, g: m.logp(t, g))
_jit_call = nnx.jit(lambda m, t: m(t))


# ----------------------------------------------------------------- eager vs jit (bitwise)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_decoder_eager_equals_jit(dtype):
  """The forward, logp and logits outside jit give the jitted program's bits (bf16 too: op by
  op, XLA rounds where the fused program does not)."""
  model = decoder(dtype)
  tokens, _ = _prompts(0)
  targets = np.roll(tokens, -1, axis=1)
  case()
  same_bits(model.logp(tokens, targets), _jit_logp(model, tokens, targets), "logp")
  same_bits(model(tokens), _jit_call(model, tokens), "forward")
  same_bits(model.logits(tokens, temperature=0.7),
            nnx.jit(lambda m, t: m.logits(t, temperature=0.7))(model, tokens), "logits")


# --------------------------------------------------------------------------- token ids


@fuzz(6)
@given(bad=st.sampled_from([V, V + 7, -1, -V, 2**31 - 1]), row=st.integers(0, B - 1),
       col=st.integers(0, P - 1), which=st.sampled_from(["decoder", "tiny"]))
def test_out_of_range_ids_are_named(bad, row, col, which):
  """A concrete id outside [0, V) is a ValueError naming the argument, index, value and V."""
  case()
  model = decoder("float32") if which == "decoder" else tiny()
  tokens, lengths = _prompts(1)
  tokens[row, col] = bad
  msg = rf"tokens must lie in \[0, {V}\), got {bad} at index \({row}, {col}\)"
  named(ValueError, msg, model, tokens)
  named(ValueError, msg, model.logp, tokens, np.zeros_like(tokens))
  if col < lengths[row]:
    named(ValueError, rf"sample: prompts must lie in \[0, {V}\), got {bad}", sample, model,
          tokens, lengths, max_new_tokens=N, key=jax.random.key(0))
  named(ValueError, r"token must lie in", model.decode_step, tokens[:, col],
        model.init_cache(B, 8))


@pytest.mark.parametrize("bad", [V, -1])
def test_traced_out_of_range_id_is_nan(bad):
  """Under jit an out-of-range id (which ``nnx.Embed`` wraps, or fills) gives a NaN hidden
  state at its position, never a finite one; the other rows keep their bits; the
  vocabulary-parallel sharded model gives the unsharded model's bits (its
  embedding gave zeros). (The row's other positions see the NaN key and value through
  attention, whose NaN handling is the attention op's contract, tested there.)"""
  case()
  model = decoder("float32")
  tokens, _ = _prompts(2)
  clean = np.asarray(_jit_call(model, tokens))
  tokens[1, 2] = bad
  out = np.asarray(_jit_call(model, tokens))
  assert np.isnan(out[1, 2]).all()
  same_bits(out[[0, 2]], clean[[0, 2]], "other rows")
  COUNTS["nan"] += 1
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  sharded = models.shard(model, models.Parallelism(mesh, tp="tp"))
  # Concrete bad ids are refused by name (as the unsharded model does); traced, NaN.
  with pytest.raises(ValueError, match="must lie in"):
    sharded(tokens)
  same_bits(_jit_call(sharded, tokens), out, "sharded (its vocabulary-parallel embedding)")


# ---------------------------------------------------------------- padding is inert


@fuzz(4)
@given(pad=st.sampled_from([V, -100, 2**31 - 1, -(2**31)]), seed=st.integers(0, 3))
def test_padding_after_lengths_is_inert(pad, seed):
  """Padding after ``prompt_lengths`` (and beyond the sequence in ``score``) of any value gives
  the tokens and log-probs of padding 0, bitwise; the sampler's log-probs are the scorer's."""
  case()
  model = decoder("float32")
  tokens, lengths = _prompts(seed)
  ref = tokens.copy()
  for r, n in enumerate(lengths):
    ref[r, n:] = 0
    tokens[r, n:] = pad
  key = jax.random.key(seed)
  a = sample(model, ref, lengths, max_new_tokens=N, key=key)
  b = sample(model, tokens, lengths, max_new_tokens=N, key=key)
  same_bits(a.tokens, b.tokens, "tokens")
  same_bits(a.logp, b.logp, "logp")
  out = np.asarray(b.tokens).copy()
  for r, n in enumerate(np.asarray(b.lengths)):
    out[r, n:] = pad
  s = score(model, out, b.completion_mask)
  assert isinstance(s, jax.Array)
  same_bits(s, b.logp, "score")


# ------------------------------------------------------------------------- empty batches


def test_empty_batches():
  """B = 0: empty results of the right shapes and types."""
  case()
  model = decoder("float32")
  r = sample(model, np.zeros((0, P), np.int32), np.zeros((0,), np.int32), max_new_tokens=N,
             key=jax.random.key(0))
  assert r.tokens.shape == r.completion_mask.shape == r.logp.shape == (0, P + N)
  assert r.lengths.shape == (0,)
  for pack in (False, True):
    s = score(model, np.zeros((0, 6), np.int32), np.zeros((0, 6), bool), pack=pack)
    assert isinstance(s, jax.Array) and s.shape == (0, 6) and s.dtype == jnp.float32
  COUNTS["agree"] += 1


# --------------------------------------------------------------------------- temperature


@fuzz(6)
@given(t=st.sampled_from([1e-42, 1e-39, 3.5e38, float("nan"), float("inf"), 0.0, -0.7]))
def test_bad_temperatures_are_named(t):
  """Temperatures whose reciprocal is not finite in float32, non-finite or <= 0 are refused by
  name everywhere (never NaN log-probs)."""
  case()
  model = decoder("float32")
  tokens, lengths = _prompts(0)
  named(ValueError, "sample: temperature must", sample, model, tokens, lengths,
        max_new_tokens=N, key=jax.random.key(0), temperature=t)
  named(ValueError, "score: temperature must", score, model, tokens,
        np.zeros_like(tokens, bool), temperature=t)
  named(ValueError, "temperature must", model.logp, tokens, tokens, temperature=t)
  named(ValueError, "linear_logp: temperature must", linear_logp, jnp.ones((2, 4)),
        jnp.ones((4, 8)), jnp.array([1, 2]), temperature=t)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sample_equals_score_at_temperature(dtype, temperature):
  """The sampler's log-probs are the scorer's bits at temperatures that are not powers of two."""
  case()
  model = decoder(dtype)
  tokens, lengths = _prompts(3)
  r = sample(model, tokens, lengths, max_new_tokens=8, key=jax.random.key(3),
             temperature=temperature)
  same_bits(score(model, r.tokens, r.completion_mask, temperature=temperature), r.logp,
            f"T={temperature}")


def test_linear_logp_mask_is_keyword_only():
  """``mask`` given positionally: the keyword-only message ``rl``'s losses give."""
  case()
  named(TypeError, r"linear_logp: takes 3 positional arguments .* mask and every option after "
        r"it are keyword-only", linear_logp, jnp.ones((2, 4)), jnp.ones((4, 8)),
        jnp.array([1, 2]), None)
