"""A mixture-of-experts DecoderLM under ``models.shard``: experts split over tp (tokens
replicated, each assignment its owner's bits), gathered per layer under fsdp; hidden
states, log-probs and the sampler's tokens equal the unsharded model's bitwise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TOL, assert_bitwise_equal, assert_sharded_gradients_match

from jaxrl_kernels import models
from jaxrl_kernels.models.config import DecoderConfig
from jaxrl_kernels.nn.sampler import sample, score

V, B, T = 1000, 8, 10


def _model(seed=0) -> models.DecoderLM:
  """qwen3_moe with a dense first layer, 8 experts top-2, weights that reveal reorderings."""
  cfg = DecoderConfig(model_type="qwen3_moe", vocab_size=V, hidden_size=64,
                      intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=16, qk_norm=True, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(0,))
  model = models.DecoderLM(cfg, dtype="float32", rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    x = np.asarray(var.get_value(), np.float32)
    name = ".".join(map(str, path))
    if name.endswith(("down", "down_proj.kernel", "o_proj.kernel")):
      x = x * np.exp2(rng.integers(-6, 7, x.shape[:-1] + (1,)))
    elif name.endswith("router"):
      x = rng.standard_normal(x.shape) * 0.5
    elif name.endswith("embedding"):
      x = rng.standard_normal(x.shape)
    elif x.ndim == 1:
      x = 1.0 + 0.2 * rng.standard_normal(x.shape)
    var.set_value(jnp.asarray(x, var.get_value().dtype))
  return model


def _needs(n: int):
  return pytest.mark.skipif(len(jax.devices()) < n,
                            reason=f"needs {n} devices (CPU: 8 host devices)")


def _trainer_mesh():
  """FSDP = 2 x DP = 2 where 4 devices exist (the CPU host mesh), FSDP = 2 on two GPUs."""
  return _mesh(1, 2, 2) if len(jax.devices()) >= 4 else _mesh(1, 2, 1)


def _mesh(tp: int, fsdp: int, dp: int):
  devices = np.array(jax.devices()[:tp * fsdp * dp]).reshape(tp, fsdp, dp)
  return models.Parallelism(jax.sharding.Mesh(devices, ("tp", "fsdp", "dp")), tp="tp",
                            fsdp="fsdp", dp="dp")


@nnx.jit
def _forward(m, tokens, targets):
  h = m(tokens)
  return h, m.head(h, targets, temperature=0.7)


@pytest.fixture(scope="module")
def moe():
  model = _model()
  rng = np.random.default_rng(1)
  tok = rng.integers(0, V, (B, T)).astype(np.int32)
  tg = np.roll(tok, -1, axis=1)
  return model, (tok, tg), _forward(model, tok, tg)


@pytest.mark.parametrize("tp,fsdp,dp", [
    pytest.param(*m, marks=_needs(m[0] * m[1] * m[2]))
    for m in ((8, 1, 1), (1, 4, 1), (2, 2, 2), (2, 1, 1))])
def test_sharded_moe_model_is_bitwise_the_unsharded(moe, tp, fsdp, dp):
  model, inputs, ref = moe
  got = _forward(models.shard(model, _mesh(tp, fsdp, dp)), *inputs)
  for name, a, b in zip(("hidden", "logp"), got, ref, strict=True):
    assert_bitwise_equal(a, b, f"tp={tp} fsdp={fsdp} dp={dp} {name}")


@_needs(2)
def test_sampler_tp_equals_trainer_fsdp_and_unsharded(moe):
  """Sampled at TP = 2 (experts split, KV heads split), scored at FSDP = 2 x DP = 2 (FSDP = 2
  on two devices) and unsharded: every sampled token's log-prob, bit for bit; the unsharded
  sampler draws the same tokens."""
  model = moe[0]
  rng = np.random.default_rng(7)
  prompts = rng.integers(0, V, (4, 6)).astype(np.int32)
  lens = np.array([6, 2, 5, 3], np.int32)
  kw = dict(max_new_tokens=4, key=jax.random.key(3), temperature=0.9)
  res = sample(models.shard(model, _mesh(2, 1, 1)), prompts, lens, **kw)
  # The sharded head draws with jax.random.categorical: the unsharded sampler's fused draw
  # (another race for the same key, nn.sample's fused_draw) is turned off to compare tokens.
  ref = sample(model, prompts, lens, fused_draw=False, **kw)
  assert_bitwise_equal(res.tokens, ref.tokens, "tokens TP=2 vs unsharded")
  assert_bitwise_equal(res.logp, ref.logp, "logp TP=2 vs unsharded")
  trainer = score(models.shard(model, _trainer_mesh()), res.tokens, res.completion_mask,
                  temperature=0.9)
  assert_bitwise_equal(trainer, res.logp, "sampler TP=2 vs trainer FSDP=2")


@_needs(2)
def test_fsdp_dp_training_gradients(moe):
  """jax.grad through the sharded MoE model's logp at FSDP = 2 x DP = 2 (FSDP = 2 on two
  devices; each layer's experts gathered under fsdp, the batch split over dp): the
  unsharded gradients within the float32 tolerance (the per-device sums are added across
  devices), every expert's and the router's included, and the same bits on every run."""
  model, (tok, tg), _ = moe
  mask = np.arange(T)[None, :] < np.array([[10], [7], [10], [3], [10], [10], [9], [10]])

  def loss(m):
    return -jnp.sum(m.logp(tok, tg, mask)) / mask.sum()

  ref = assert_sharded_gradients_match(loss, model, models.shard(model, _trainer_mesh()),
                                       TOL["float32"][1])
  assert any("router" in map(str, path) for path in ref)


@_needs(3)
def test_tp_must_split_the_experts_evenly():
  model = _model()
  devices = np.array(jax.devices()[:3]).reshape(3, 1, 1)
  mesh = models.Parallelism(jax.sharding.Mesh(devices, ("tp", "fsdp", "dp")), tp="tp")
  with pytest.raises(ValueError, match="num_experts=8"):
    models.shard(model, mesh)
