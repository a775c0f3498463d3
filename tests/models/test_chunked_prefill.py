"""Chunked prefill: a prompt prefilled ``C`` positions at a time gives the one-pass prefill's
cache and hidden states bitwise, and so the sampler's tokens and log-probs."""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_bitwise_equal

from jaxrl_kernels import models
from jaxrl_kernels.nn.sampler import sample, score


def _model(dtype):
  cfg = models.config("qwen2.5-0.5b", num_hidden_layers=1, vocab_size=256, hidden_size=64,
                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16)
  return models.DecoderLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(3))


PROMPTS = np.random.default_rng(5).integers(0, 256, (3, 11)).astype(np.int32)
LENS = np.array([11, 4, 7], np.int32)


@nnx.jit(static_argnames=("chunk",))
def _prefill(model, prompts, lens, chunk):
  return model.prefill(prompts, lens, model.init_cache(3, 32), chunk=chunk)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_chunks_give_the_one_pass_cache_and_hidden_states(dtype):
  model = _model(dtype)
  h, cache = _prefill(model, PROMPTS, LENS, None)
  for chunk in (1, 4, 16):  # per token (as decode), a tail chunk, one chunk past the prompt
    hc, cc = _prefill(model, PROMPTS, LENS, chunk)
    assert_bitwise_equal(hc, h, f"hidden, chunk={chunk}")
    np.testing.assert_array_equal(np.asarray(cc.lengths), LENS)
    for layer, (k, kc, v, vc) in enumerate(zip(cache.keys, cc.keys, cache.values, cc.values)):
      for r, n in enumerate(LENS):
        assert_bitwise_equal(kc[r, :n], k[r, :n], f"keys layer {layer} row {r} chunk {chunk}")
        assert_bitwise_equal(vc[r, :n], v[r, :n], f"values layer {layer} row {r}")


def test_sampling_after_a_chunked_prefill_keeps_the_tokens_and_log_probs():
  model = _model("float32")
  kw = dict(max_new_tokens=5, key=jax.random.key(2), temperature=0.9)
  one = sample(model, PROMPTS, LENS, **kw)
  chunked = sample(model, PROMPTS, LENS, prefill_chunk=4, **kw)
  np.testing.assert_array_equal(np.asarray(chunked.tokens), np.asarray(one.tokens))
  assert_bitwise_equal(chunked.logp, one.logp, "logp")
  got = score(model, chunked.tokens, chunked.completion_mask, temperature=0.9)
  assert_bitwise_equal(got, np.asarray(chunked.logp), "score vs sampler")


def test_bad_chunks_are_refused():
  model = _model("float32")
  for bad in (0, -2, 2.0, True):
    with pytest.raises(ValueError, match="chunk must be None or a static int >= 1"):
      model.prefill(PROMPTS, LENS, model.init_cache(3, 32), chunk=bad)
  with pytest.raises(ValueError, match="prefill_chunk must be None or an int >= 1"):
    sample(model, PROMPTS, LENS, max_new_tokens=2, key=jax.random.key(0), prefill_chunk=0)
  stock = models.DecoderLM(model.config, implementation="xla", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="implementation='xla'"):
    stock.prefill(PROMPTS, LENS, stock.init_cache(3, 32), chunk=4)
  # The cache must hold the chunks too.
  with pytest.raises(ValueError, match="do not fit a cache"):
    model.prefill(PROMPTS, LENS, model.init_cache(3, 8), chunk=4)
