"""``policy_loss`` (the policy loss fused into the LM head) on a model sharded by
``models.shard`` on the host mesh: with FSDP = 2 x DP = 2, the unsharded model's ``logp``
bits, its loss and metrics to float rounding (the devices' token sums are added), gradients
within the float32 tolerance of the unsharded ones and the same bits on every run; with
TP = 2 (the vocab-parallel fused loss) the same forward, and a gradient refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TOL, assert_bitwise_equal, assert_sharded_gradients_match, rel_err

from jaxrl_kernels import models
from jaxrl_kernels.models.config import DecoderConfig

V, B, T = 600, 4, 10


def test_fused_policy_loss_under_fsdp_and_dp():
  cfg = DecoderConfig(model_type="qwen2", vocab_size=V, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, attention_bias=True, tie_word_embeddings=False)
  model = models.DecoderLM(cfg, dtype="float32", rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  tok = rng.integers(0, V, (B, T)).astype(np.int32)
  tg = np.roll(tok, -1, axis=1)
  mask = np.arange(T)[None, :] < np.array([[T], [6], [T], [3]])
  old = np.asarray(model.logp(tok, tg, mask)) + 0.2 * rng.standard_normal((B, T))
  old = jnp.asarray(np.where(mask, old, 0.0), jnp.float32)
  adv = jnp.asarray(rng.standard_normal(B), jnp.float32)
  kw = dict(old_logp=old, advantages=adv, entropy_coef=0.01, clip_low=0.2, clip_high=0.28)

  def loss(m):
    return m.policy_loss(tok, tg, mask, **kw)[0]

  def sharded(tp, fsdp, dp):
    devices = np.array(jax.devices()[:tp * fsdp * dp]).reshape(tp, fsdp, dp)
    mesh = jax.sharding.Mesh(devices, ("tp", "fsdp", "dp"))
    return models.shard(model, models.Parallelism(mesh, tp="tp", fsdp="fsdp", dp="dp"))

  value = nnx.jit(lambda m: m.policy_loss(tok, tg, mask, **kw))
  l_u, m_u = value(model)
  layouts = {(1, 2, 2): sharded(1, 2, 2), (2, 1, 1): sharded(2, 1, 1)}
  for layout, sm in layouts.items():
    l_s, m_s = value(sm)
    assert_bitwise_equal(m_s["logp"], m_u["logp"], f"logp, (tp, fsdp, dp) = {layout}")
    assert_bitwise_equal(m_s["entropy"], m_u["entropy"], f"entropy, {layout}")
    assert sorted(m_s) == sorted(m_u)
    for name in m_u:
      assert rel_err(m_s[name], m_u[name]) <= 1e-6, (layout, name)
    assert rel_err(l_s, l_u) <= 1e-6, layout
  assert_sharded_gradients_match(loss, model, layouts[1, 2, 2], TOL["float32"][1])
  with pytest.raises(ValueError, match="tp > 1 is forward-only"):
    nnx.jit(nnx.grad(loss))(layouts[2, 1, 1])
