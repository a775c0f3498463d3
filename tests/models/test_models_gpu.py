"""On the GPU, at real shapes (random weights): every sampled token's log-prob equals the
trainer's recomputation bit for bit, and decode == prefill, for each architecture."""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_bitwise_equal

from jaxrl_kernels import models
from jaxrl_kernels.nn.sampler import sample, score

# (preset, config overrides): Qwen3-8B with 8 of its 36 layers keeps the test's memory and
# compile time small; the per-layer shapes are the real ones.
CASES = [("qwen2.5-0.5b", {}), ("llama-3.2-1b", {}), ("qwen3-8b", {"num_hidden_layers": 8})]


@pytest.mark.gpu
@pytest.mark.parametrize("name, over", CASES, ids=[c[0] for c in CASES])
def test_real_shape_sampler_equals_trainer_gpu(name, over):
  model = models.preset(name, jax.random.key(0), "bfloat16", **over)
  v = model.config.vocab_size
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, v, (8, 96)).astype(np.int32)
  lens = rng.integers(16, 97, 8).astype(np.int32)
  res = sample(model, prompts, lens, max_new_tokens=48, key=jax.random.key(1), top_p=0.95)
  m = np.asarray(res.completion_mask)
  assert m.sum() == 8 * 48
  got = score(model, res.tokens, res.completion_mask, batch_size=3, pack=True)
  assert_bitwise_equal(got, np.asarray(res.logp), f"{name}: trainer vs sampler")


@pytest.mark.gpu
def test_real_shape_decode_equals_prefill_gpu():
  model = models.preset("qwen2.5-0.5b", jax.random.key(2), "bfloat16")
  seq = np.random.default_rng(1).integers(0, model.config.vocab_size, (4, 80)).astype(np.int32)
  full = np.asarray(nnx.jit(lambda m, t: m(t))(model, seq))
  h, cache = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c))(
      model, seq[:, :64], np.full((4,), 64, np.int32), model.init_cache(4, 80))
  assert_bitwise_equal(np.asarray(h), full[:, 63], "prefill")
  step = nnx.jit(lambda m, t, c: m.decode_step(t, c))
  for t in range(64, 80):
    h, cache = step(model, seq[:, t], cache)
    assert_bitwise_equal(np.asarray(h), full[:, t], f"decode {t}")
