"""Qwen3-MoE and Mixtral: config round trips and refusals, the forward against a float64
numpy reference written here from transformers' modeling semantics, batch invariance of
the log-probs (bitwise, with the stock control), sampler == trainer, the Hugging Face
file names and a bitwise save/load round trip, gradients and the router loss."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_bitwise_equal, rel_err

from jaxrl_kernels import models
from jaxrl_kernels.models.hf import read_safetensors, write_safetensors
from jaxrl_kernels.nn.sampler import sample, score

V, H, L, HEADS, KV, D = 64, 32, 2, 4, 2, 8
E, K, I_MOE, FF = 4, 2, 16, 24
#: qwen3_moe with a dense first layer (mlp_only_layers) and normalized top-k; qwen3_moe
#: with raw top-k weights (transformers' default); mixtral.
VARIANTS = {
    "qwen3_moe": dict(model_type="qwen3_moe", mlp_only_layers=[0], norm_topk_prob=True),
    "qwen3_moe_raw": dict(model_type="qwen3_moe", mlp_only_layers=[], norm_topk_prob=False),
    "mixtral": dict(model_type="mixtral"),
}


def _hf_config(variant: str) -> dict:
  v = VARIANTS[variant]
  cfg = dict(model_type=v["model_type"], vocab_size=V, hidden_size=H, num_hidden_layers=L,
             num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D,
             rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0,
             tie_word_embeddings=False, max_position_embeddings=256, bos_token_id=1,
             eos_token_id=2, torch_dtype="float32", num_experts_per_tok=K,
             router_aux_loss_coef=0.01, output_router_logits=False)
  if v["model_type"] == "mixtral":
    cfg.update(num_local_experts=E, intermediate_size=I_MOE, sliding_window=None,
               router_jitter_noise=0.0)
  else:
    cfg.update(num_experts=E, moe_intermediate_size=I_MOE, intermediate_size=FF,
               norm_topk_prob=v["norm_topk_prob"], decoder_sparse_step=1,
               mlp_only_layers=v["mlp_only_layers"], use_sliding_window=False,
               attention_bias=False)
  return cfg


def _moe_names(cfg: dict, i: int) -> tuple[str, tuple[str, str, str]]:
  if cfg["model_type"] == "mixtral":
    return f"model.layers.{i}.block_sparse_moe", ("w1", "w3", "w2")
  return f"model.layers.{i}.mlp", ("gate_proj", "up_proj", "down_proj")


def _is_moe(cfg: dict, i: int) -> bool:
  return i not in cfg.get("mlp_only_layers", [])


def _hf_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
  """Random float32 tensors under transformers' names and layouts (Linear: [out, in])."""
  rng = np.random.default_rng(seed)

  def w(*shape, std=0.15):
    return (rng.standard_normal(shape) * std).astype(np.float32)

  def norm(n):
    return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

  out = {"model.embed_tokens.weight": w(V, H, std=1.0), "model.norm.weight": norm(H),
         "lm_head.weight": w(V, H, std=0.3)}
  for i in range(L):
    p = f"model.layers.{i}."
    out.update({p + "input_layernorm.weight": norm(H),
                p + "post_attention_layernorm.weight": norm(H),
                p + "self_attn.q_proj.weight": w(HEADS * D, H),
                p + "self_attn.k_proj.weight": w(KV * D, H),
                p + "self_attn.v_proj.weight": w(KV * D, H),
                p + "self_attn.o_proj.weight": w(H, HEADS * D)})
    if cfg["model_type"] == "qwen3_moe":
      out[p + "self_attn.q_norm.weight"] = norm(D)
      out[p + "self_attn.k_norm.weight"] = norm(D)
    if _is_moe(cfg, i):
      block, (g, u, d) = _moe_names(cfg, i)
      out[f"{block}.gate.weight"] = w(E, H, std=0.5)
      for e in range(E):
        out[f"{block}.experts.{e}.{g}.weight"] = w(I_MOE, H)
        out[f"{block}.experts.{e}.{u}.weight"] = w(I_MOE, H)
        out[f"{block}.experts.{e}.{d}.weight"] = w(H, I_MOE)
    else:
      out.update({p + "mlp.gate_proj.weight": w(FF, H), p + "mlp.up_proj.weight": w(FF, H),
                  p + "mlp.down_proj.weight": w(H, FF)})
  return out


def _write_folder(path, cfg: dict, weights: dict) -> str:
  path = str(path)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)
  write_safetensors(weights, os.path.join(path, "model.safetensors"))
  return path


# ------------------------------------------------------------- float64 reference forward


def _ref_logits(cfg: dict, w: dict, tokens: np.ndarray) -> np.ndarray:
  """transformers' Qwen3-MoE / Mixtral forward in float64: ``[B, T, V]`` logits."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  eps = cfg["rms_norm_eps"]
  norm_topk = cfg["model_type"] == "mixtral" or cfg["norm_topk_prob"]

  def rms(x, g):
    return g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)

  def lin(x, name):
    return x @ w[name + ".weight"].T

  def silu(x):
    return x / (1 + np.exp(-x))

  b, t = tokens.shape
  inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, D, 2) / D)
  ang = np.arange(t)[:, None] * inv[None]
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

  def rope(x):  # [B, T, h, d]
    rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos[None, :, None] + rot * sin[None, :, None]

  def moe(h, block, names):  # h [N, H]
    g, u, d = names
    logits = lin(h, block + ".gate")
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :K]
    wt = np.take_along_axis(probs, top, -1)
    if norm_topk:
      wt = wt / wt.sum(-1, keepdims=True)
    y = np.zeros_like(h)
    for n in range(h.shape[0]):
      for j in range(K):
        ex = f"{block}.experts.{top[n, j]}"
        act = silu(lin(h[n], f"{ex}.{g}")) * lin(h[n], f"{ex}.{u}")
        y[n] += wt[n, j] * lin(act, f"{ex}.{d}")
    return y

  x = w["model.embed_tokens.weight"][tokens]
  causal = np.tril(np.ones((t, t), bool))
  for i in range(L):
    p = f"model.layers.{i}."
    h = rms(x, w[p + "input_layernorm.weight"])
    q = lin(h, p + "self_attn.q_proj").reshape(b, t, HEADS, D)
    k = lin(h, p + "self_attn.k_proj").reshape(b, t, KV, D)
    v = lin(h, p + "self_attn.v_proj").reshape(b, t, KV, D)
    if cfg["model_type"] == "qwen3_moe":
      q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
    q, k = rope(q), rope(k)
    k, v = np.repeat(k, HEADS // KV, axis=2), np.repeat(v, HEADS // KV, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    s = np.where(causal, s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    a = np.einsum("bhqk,bkhd->bqhd", pr, v).reshape(b, t, HEADS * D)
    x = x + lin(a, p + "self_attn.o_proj")
    h = rms(x, w[p + "post_attention_layernorm.weight"])
    if _is_moe(cfg, i):
      x = x + moe(h.reshape(b * t, H), *_moe_names(cfg, i)).reshape(b, t, H)
    else:
      g = lin(h, p + "mlp.gate_proj")
      x = x + lin(silu(g) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
  x = rms(x, w["model.norm.weight"])
  return x @ w["lm_head.weight"].T


# ------------------------------------------------------------------------------ fixtures


_FOLDERS: dict = {}


def _folder(variant: str, tmp_path_factory):
  if variant not in _FOLDERS:
    cfg = _hf_config(variant)
    weights = _hf_weights(cfg, seed=list(VARIANTS).index(variant))
    path = _write_folder(tmp_path_factory.mktemp(variant), cfg, weights)
    _FOLDERS[variant] = cfg, weights, path
  return _FOLDERS[variant]


@pytest.fixture(scope="module", params=list(VARIANTS))
def folder(request, tmp_path_factory):
  return (request.param, *_folder(request.param, tmp_path_factory))


_TOKENS = np.random.default_rng(5).integers(0, V, (2, 11)).astype(np.int32)

#: The compile-heavy tests run one variant in CI (qwen3_moe: a dense and a MoE layer,
#: normalized top-k); the others are marked slow.
HEAVY = [pytest.param(v, marks=() if v == "qwen3_moe" else pytest.mark.slow)
         for v in VARIANTS]


# -------------------------------------------------------------------------------- config


def test_config_reads_the_moe_keys(folder):
  variant, cfg, _, path = folder
  c = models.from_pretrained(path).config
  assert c.model_type == cfg["model_type"] and c.num_experts == E
  assert c.num_experts_per_tok == K and c.moe_intermediate_size == I_MOE
  assert c.router_aux_loss_coef == 0.01
  assert c.qk_norm == (c.model_type == "qwen3_moe")
  if variant == "mixtral":
    assert c.intermediate_size == I_MOE and c.norm_topk_prob
  else:
    assert c.intermediate_size == FF and c.norm_topk_prob == cfg["norm_topk_prob"]
    assert c.mlp_only_layers == tuple(cfg["mlp_only_layers"])
  assert [c.is_moe_layer(i) for i in range(L)] == [_is_moe(cfg, i) for i in range(L)]
  back = c.to_hf_dict()
  arch = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
  assert back["architectures"] == [arch[c.model_type]]
  for key, value in cfg.items():  # every key transformers reads comes back unchanged
    if key not in ("torch_dtype",):
      assert back[key] == value, key
  assert models.from_hf_dict(json.loads(json.dumps(back))) == c


def test_config_defaults_are_transformers():
  base = dict(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=L,
              num_attention_heads=8)
  q = models.from_hf_dict(dict(base, model_type="qwen3_moe"))
  assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size) == (128, 8, 768)
  assert not q.norm_topk_prob and q.decoder_sparse_step == 1 and q.mlp_only_layers == ()
  # Qwen3-MoE's attention reads head_dim with the fallback hidden_size // heads.
  assert q.num_key_value_heads == 4 and q.head_dim == H // 8 and q.qk_norm
  m = models.from_hf_dict(dict(base, model_type="mixtral"))
  assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (8, 2, FF)
  assert m.norm_topk_prob and m.num_key_value_heads == 8 and not m.qk_norm
  assert (m.rope_theta, m.rms_norm_eps) == (1e6, 1e-5)
  # decoder_sparse_step: transformers' rule (i + 1) % step == 0, minus mlp_only_layers.
  s = models.from_hf_dict(dict(base, model_type="qwen3_moe", num_hidden_layers=6,
                               decoder_sparse_step=2, mlp_only_layers=[3]))
  assert [s.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
  dense = models.from_hf_dict(dict(base, model_type="qwen3", num_key_value_heads=2))
  assert dense.num_experts == 0 and not any(dense.is_moe_layer(i) for i in range(L))


@pytest.mark.parametrize("variant,change,match", [
    ("mixtral", dict(sliding_window=4096), "sliding_window must be null"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise must be 0"),
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok must be in"),
    ("qwen3_moe", dict(num_experts_per_tok=5), "num_experts_per_tok must be in"),
    ("qwen3_moe", dict(num_experts_per_tok=0), "num_experts_per_tok must be an int"),
    ("qwen3_moe", dict(num_experts=0), "num_experts must be an int"),
    # null is not "absent": transformers refuses it, so no default is silently taken.
    ("qwen3_moe", dict(moe_intermediate_size=None), "moe_intermediate_size must be an int"),
    ("qwen3_moe", dict(num_experts_per_tok=None), "num_experts_per_tok must be an int"),
    ("qwen3_moe", dict(num_experts=None), "num_experts must be an int"),
    ("qwen3_moe", dict(decoder_sparse_step=None), "decoder_sparse_step must be an int"),
    ("qwen3_moe", dict(router_aux_loss_coef=None), "router_aux_loss_coef must be a number"),
    ("mixtral", dict(num_experts_per_tok=None), "num_experts_per_tok must be an int"),
    ("mixtral", dict(num_local_experts=None), "num_local_experts must be an int"),
    ("mixtral", dict(num_local_experts=4, num_experts=None), "num_experts must be an int"),
    # Qwen2-MoE's shared experts are not implemented: refused by its model_type.
    ("qwen3_moe", dict(model_type="qwen2_moe", shared_expert_intermediate_size=64),
     "model_type must be one of"),
    ("qwen3_moe", dict(mlp_only_layers=[2]), "mlp_only_layers must be a tuple"),
    ("qwen3_moe", dict(mlp_only_layers="0"), "mlp_only_layers must be a list"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step must be an int"),
    ("qwen3_moe", dict(norm_topk_prob=1), "norm_topk_prob must be true or false"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias=true is not supported"),
    ("qwen3_moe", dict(use_sliding_window=True), "use_sliding_window"),
    ("qwen3_moe", dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef must be"),
])
def test_bad_moe_config_named_error(variant, change, match):
  cfg = dict(_hf_config(variant), **change)
  with pytest.raises(ValueError, match=match):
    models.from_hf_dict(cfg)


def test_dataclass_refusals_name_the_field():
  kw = dict(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=L,
            num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D)
  with pytest.raises(ValueError, match="num_experts, num_experts_per_tok and "
                                       "moe_intermediate_size must be 0"):
    models.DecoderConfig(model_type="qwen3", num_experts=4, **kw)
  with pytest.raises(ValueError, match="moe_intermediate_size must be an int"):
    models.DecoderConfig(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, **kw)
  with pytest.raises(ValueError, match="norm_topk_prob must be True"):
    models.DecoderConfig(model_type="mixtral", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=FF, norm_topk_prob=False, **kw)
  with pytest.raises(ValueError, match="moe_intermediate_size must equal intermediate_size"):
    models.DecoderConfig(model_type="mixtral", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=8, **kw)


def test_moe_presets():
  """The public configs (30.5B and 46.7B parameters), their config.json round trip, and
  preset() with overrides building a model of the counted size."""
  assert models.config("qwen3-30b-a3b").num_params() == 30_532_122_624
  assert models.config("mixtral-8x7b").num_params() == 46_702_792_704
  q = models.config("qwen3-30b-a3b", num_hidden_layers=2)
  assert q.num_hidden_layers == 2 and q.num_experts == 128 and q.head_dim == 128
  over = dict(num_hidden_layers=2, vocab_size=256, hidden_size=64, num_experts=4,
              num_experts_per_tok=2, mlp_only_layers=(0,))
  small = models.preset("qwen3-30b-a3b", 0, "float32", **over)
  assert models.decoder.num_params(small) == models.config("qwen3-30b-a3b", **over).num_params()
  assert isinstance(small.layers[1].mlp, models.decoder.MoEMLP)
  assert isinstance(small.layers[0].mlp, models.decoder.MLP)
  over = dict(num_hidden_layers=1, vocab_size=256, hidden_size=64, intermediate_size=32,
              moe_intermediate_size=32)
  mx = models.preset("mixtral-8x7b", 0, "float32", **over)
  assert models.decoder.num_params(mx) == models.config("mixtral-8x7b", **over).num_params()
  assert mx.layers[0].mlp.gate_up.shape == (8, 64, 64)


# ------------------------------------------------------------------------------- forward


@nnx.jit
def _logits_and_logp(model, tokens):
  targets = jnp.roll(tokens, -1, axis=1)
  return model.logits(tokens), model.logp(tokens, targets)


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_forward_matches_float64_reference(folder, implementation):
  """float32 logits and log-probs against transformers' semantics in float64: relative
  error (Frobenius) <= 1e-5 (CONTRACT.md section 2), elementwise within 2e-4."""
  _, cfg, weights, path = folder
  model = models.from_pretrained(path, implementation=implementation)
  assert model.dtype == jnp.float32
  ref = _ref_logits(cfg, weights, _TOKENS)
  z, lp = _logits_and_logp(model, jnp.asarray(_TOKENS))
  assert rel_err(z, ref) <= 1e-5, rel_err(z, ref)
  np.testing.assert_allclose(np.asarray(z), ref, rtol=2e-4, atol=2e-4)
  lse = np.log(np.sum(np.exp(ref - ref.max(-1, keepdims=True)), -1)) + ref.max(-1)
  ref_lp = np.take_along_axis(ref, np.roll(_TOKENS, -1, 1)[..., None], -1)[..., 0] - lse
  np.testing.assert_allclose(np.asarray(lp), ref_lp, rtol=2e-4, atol=2e-4)


# ------------------------------------------------------------------ invariance (bitwise)


def _batch_invariance(model, n: int, t: int, seed: int):
  """Row 0 of ``n`` random rows alone and in the batch (other rows random, the row's last
  tokens right padding): ``(alone, in_batch)`` log-probs of its first ``t - 3`` tokens."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (n, t)).astype(np.int32)
  targets = np.roll(tokens, -1, axis=1)
  keep = t - 3
  alone = model.logp(tokens[:1, :keep], targets[:1, :keep])
  batch = model.logp(tokens, targets)
  return np.asarray(alone)[0], np.asarray(batch)[0, :keep]


@pytest.mark.parametrize("variant", HEAVY)
def test_logp_batch_invariant_bitwise(variant, tmp_path_factory):
  """A sequence's log-probs alone equal its log-probs padded inside a batch of 5
  sequences, bit for bit (implementation="cpu"); the stock path (implementation="xla")
  changes bits on the same inputs (the control)."""
  _, _, path = _folder(variant, tmp_path_factory)
  alone, batch = _batch_invariance(models.from_pretrained(path, implementation="cpu"), 5, 16,
                                   seed=5)
  assert_bitwise_equal(alone, batch, f"{variant}: batch 5x16")
  alone, batch = _batch_invariance(models.from_pretrained(path, implementation="xla"), 5, 16,
                                   seed=5)
  np.testing.assert_allclose(alone, batch, rtol=1e-4, atol=1e-4)
  assert not np.array_equal(alone.view(np.uint32), batch.view(np.uint32)), (
      f"{variant}: the stock control gave the same bits")


@pytest.mark.parametrize("variant", HEAVY)
def test_route_keeps_the_bits_and_the_router_loss(variant, tmp_path_factory):
  """route's hidden states are __call__'s bits; router_aux_loss is transformers'
  load_balancing_loss_func on its probabilities (masked positions left out)."""
  cfg, _, path = _folder(variant, tmp_path_factory)
  model = models.from_pretrained(path, implementation="cpu")
  tokens = jnp.asarray(_TOKENS)
  h, routing = model.route(tokens)
  assert_bitwise_equal(np.asarray(h), np.asarray(model(tokens)), f"{variant}: route hidden")
  assert len(routing) == sum(_is_moe(cfg, i) for i in range(L))
  mask = np.ones(_TOKENS.shape, bool)
  mask[1, 7:] = False
  got = float(model.router_aux_loss(routing, jnp.asarray(mask)))
  probs = np.concatenate([np.asarray(p, np.float64) for p, _ in routing])
  top = np.argsort(-probs, -1, kind="stable")[:, :K]  # the experts: the top-k probabilities
  assert np.array_equal(np.concatenate([np.asarray(e) for _, e in routing]), top)
  m = np.tile(mask.reshape(-1), len(routing)).astype(np.float64)
  onehot = (top[..., None] == np.arange(E)).astype(np.float64)  # [T, k, E]
  f = (onehot * m[:, None, None]).sum(0) / m.sum()
  pe = (probs * m[:, None]).sum(0) / m.sum()
  np.testing.assert_allclose(got, E * np.sum(f * pe[None]), rtol=1e-6)


# ---------------------------------------------------------------- sampler == trainer


@pytest.mark.parametrize("variant", HEAVY)
def test_sampler_greedy_equals_trainer_bitwise(variant, tmp_path_factory):
  """Greedy decoding (top_k=1) at batch 3: every token is the argmax of the full-sequence
  logits, and the sampler's log-probs are model.logp's recomputation, bit for bit."""
  _, _, path = _folder(variant, tmp_path_factory)
  model = models.from_pretrained(path, implementation="cpu")
  rng = np.random.default_rng(11)
  prompts = rng.integers(0, V, (3, 5)).astype(np.int32)
  lens = np.array([5, 2, 4], np.int32)
  res = sample(model, prompts, lens, max_new_tokens=6, key=jax.random.key(3), top_k=1)
  m = np.asarray(res.completion_mask)
  lp = np.asarray(res.logp)
  assert m.sum() == 18 and np.all(lp[m] <= 0) and np.all(np.isfinite(lp))
  got = score(model, res.tokens, res.completion_mask, batch_size=1, pack=True)
  assert_bitwise_equal(got, lp, f"{variant}: score vs sampler")
  tokens = np.asarray(res.tokens)
  z = np.asarray(model.logits(jnp.asarray(tokens)))
  # completion_mask marks the sampled tokens; position p - 1 predicted token p.
  assert not m[:, 0].any()
  nxt = m[:, 1:]
  assert np.array_equal(np.argmax(z, -1)[:, :-1][nxt], tokens[:, 1:][nxt]), variant
  full = np.asarray(model.logp(jnp.asarray(tokens), jnp.roll(jnp.asarray(tokens), -1, 1)))
  assert_bitwise_equal(full[:, :-1][nxt], lp[:, 1:][nxt], f"{variant}: logp vs sampler")


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_keeps_the_bits(variant, tmp_path_factory):
  """A prompt prefilled 2 positions at a time (DecoderLayer.extend) samples the same
  tokens and log-probs as the one-pass prefill."""
  _, _, path = _folder(variant, tmp_path_factory)
  model = models.from_pretrained(path, implementation="cpu")
  prompts = np.random.default_rng(11).integers(0, V, (3, 5)).astype(np.int32)
  lens = np.array([5, 2, 4], np.int32)
  kw = dict(max_new_tokens=6, key=jax.random.key(3), top_k=1)
  one = sample(model, prompts, lens, **kw)
  chunked = sample(model, prompts, lens, prefill_chunk=2, **kw)
  assert np.array_equal(np.asarray(one.tokens), np.asarray(chunked.tokens))
  assert_bitwise_equal(np.asarray(chunked.logp), np.asarray(one.logp), variant)


# ------------------------------------------------------------------------------- files


def test_save_load_round_trip_bitwise_with_hf_names(folder, tmp_path):
  """save_pretrained writes exactly transformers' tensor names (per-expert tensors, the
  dense layer's names for mlp_only_layers) with the bits that were loaded; from_pretrained
  of it gives the same parameters; a sharded save loads the same."""
  variant, cfg, weights, path = folder
  model = models.from_pretrained(path, implementation="cpu")
  out = str(tmp_path / "saved")
  models.save_pretrained(model, out)
  saved = read_safetensors(os.path.join(out, "model.safetensors"))
  assert sorted(saved) == sorted(weights)
  block, (g, _, d) = _moe_names(cfg, L - 1)
  assert f"{block}.experts.{E - 1}.{g}.weight" in saved and f"{block}.gate.weight" in saved
  assert saved[f"{block}.experts.0.{d}.weight"].shape == (H, I_MOE)
  for name, x in weights.items():
    assert_bitwise_equal(np.asarray(saved[name]), x, name)
  with open(os.path.join(out, "config.json")) as f:
    assert models.from_hf_dict(json.load(f)) == model.config
  again = models.from_pretrained(out, implementation="cpu")
  sharded = str(tmp_path / "sharded")
  models.save_pretrained(model, sharded, max_shard_bytes=4096)
  assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
  third = models.from_pretrained(sharded, implementation="cpu")
  ref = nnx.to_flat_state(nnx.state(model, nnx.Param))
  for other in (again, third):
    for (p, a), (q, b) in zip(ref, nnx.to_flat_state(nnx.state(other, nnx.Param)),
                              strict=True):
      assert p == q
      assert_bitwise_equal(np.asarray(b.get_value()), np.asarray(a.get_value()), str(p))


def test_transformers_5_fused_expert_tensors_load_the_same(folder, tmp_path):
  """A folder in transformers 5's fused expert layout (``{mlp}.experts.gate_up_proj``
  ``[E, 2I, H]`` gate rows then up rows, ``experts.down_proj`` ``[E, H, I]``; Mixtral's
  block named ``mlp``) loads the same parameters bitwise as the per-expert names."""
  _, cfg, weights, path = folder
  fused = dict(weights)
  for i in range(L):
    if not _is_moe(cfg, i):
      continue
    block, (g, u, d) = _moe_names(cfg, i)
    new = f"model.layers.{i}.mlp"
    gate = [fused.pop(f"{block}.experts.{e}.{g}.weight") for e in range(E)]
    up = [fused.pop(f"{block}.experts.{e}.{u}.weight") for e in range(E)]
    down = [fused.pop(f"{block}.experts.{e}.{d}.weight") for e in range(E)]
    fused[f"{new}.experts.gate_up_proj"] = np.concatenate([np.stack(gate), np.stack(up)], 1)
    fused[f"{new}.experts.down_proj"] = np.stack(down)
    fused[f"{new}.gate.weight"] = fused.pop(f"{block}.gate.weight")
  ref = models.from_pretrained(path, implementation="cpu")
  got = models.from_pretrained(_write_folder(tmp_path / "v5", cfg, fused), implementation="cpu")
  for (p, a), (q, b) in zip(nnx.to_flat_state(nnx.state(ref, nnx.Param)),
                            nnx.to_flat_state(nnx.state(got, nnx.Param)), strict=True):
    assert p == q
    assert_bitwise_equal(np.asarray(b.get_value()), np.asarray(a.get_value()), str(p))


def test_missing_expert_tensor_named(folder, tmp_path):
  _, cfg, weights, _ = folder
  block, (_, u, _) = _moe_names(cfg, L - 1)
  name = f"{block}.experts.2.{u}.weight"
  path = _write_folder(tmp_path / "m", cfg, {k: v for k, v in weights.items() if k != name})
  with pytest.raises(ValueError, match=f"tensor {name} .* is missing"):
    models.from_pretrained(path)


def test_tensors_without_a_place_are_refused(folder, tmp_path):
  """A shared expert (Qwen2-MoE's, under a qwen3_moe or mixtral config that transformers
  would load without it) and an expert index >= E: refused, naming the tensor."""
  _, cfg, weights, _ = folder
  block, (g, _, _) = _moe_names(cfg, L - 1)
  for name in (f"{block}.shared_expert.gate_proj.weight", f"{block}.experts.{E}.{g}.weight"):
    path = _write_folder(tmp_path / str(len(name)), cfg,
                         dict(weights, **{name: np.zeros((I_MOE, H), np.float32)}))
    with pytest.raises(ValueError, match=f"no place for: \\['{name}'\\]"):
      models.from_pretrained(path)


def test_an_expert_tensor_given_twice_is_refused(folder, tmp_path):
  """A folder holding one weight under two names (transformers 5's fused expert tensor
  beside the per-expert ones, Mixtral's router as ``mlp.gate`` beside
  ``block_sparse_moe.gate``) or in two shards: a ValueError naming the tensor, never one
  copy silently chosen."""
  _, cfg, weights, _ = folder
  block, (_, _, d) = _moe_names(cfg, L - 1)
  down = np.stack([weights[f"{block}.experts.{e}.{d}.weight"] for e in range(E)])
  both = dict(weights, **{f"model.layers.{L - 1}.mlp.experts.down_proj": 2 * down})
  path = _write_folder(tmp_path / "fused", cfg, both)
  with pytest.raises(ValueError, match=rf"{block}.experts.0.{d}.weight .*twice"):
    models.from_pretrained(path)
  if cfg["model_type"] == "mixtral":
    gate = weights[f"{block}.gate.weight"]
    both = dict(weights, **{f"model.layers.{L - 1}.mlp.gate.weight": 3 * gate})
    path = _write_folder(tmp_path / "gate", cfg, both)
    with pytest.raises(ValueError, match=rf"{block}.gate.weight .*twice"):
      models.from_pretrained(path)
  # Two shards, both holding one expert's tensor (with other values): the index maps it to
  # one file, transformers would read both.
  name = f"{block}.experts.1.{d}.weight"
  path = str(tmp_path / "sharded")
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)
  rest = {k: v for k, v in weights.items() if k != name}
  write_safetensors(rest, os.path.join(path, "model-00001-of-00002.safetensors"))
  write_safetensors({name: weights[name], "lm_head.weight": weights["lm_head.weight"] * 2},
                    os.path.join(path, "model-00002-of-00002.safetensors"))
  weight_map = dict.fromkeys(rest, "model-00001-of-00002.safetensors")
  weight_map[name] = "model-00002-of-00002.safetensors"
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"weight_map": weight_map}, f)
  with pytest.raises(ValueError, match=r"lm_head.weight .*twice"):
    models.from_pretrained(path)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("variant", HEAVY)
def test_gradients_reach_the_experts(variant, tmp_path_factory):
  """jax.grad of the log-prob sum (plus the router loss): finite, and nonzero on every MoE
  parameter (router, gate_up, down)."""
  cfg, _, path = _folder(variant, tmp_path_factory)
  model = models.from_pretrained(path, implementation="cpu")
  tokens = jnp.asarray(_TOKENS)
  targets = jnp.roll(tokens, -1, axis=1)

  def loss(m):
    h, routing = m.route(tokens)
    return -jnp.sum(m.head(h, targets)) + m.router_aux_loss(routing)

  grads = nnx.jit(nnx.grad(loss))(model)  # jitted: eager op-by-op is ~5x slower here
  flat = nnx.to_flat_state(grads)
  assert all(np.all(np.isfinite(np.asarray(v.get_value()))) for _, v in flat)
  moe = {p[-1]: v for p, v in flat if p[-1] in ("router", "gate_up", "down")}
  assert len([p for p, _ in flat if p[-1] == "router"]) == sum(_is_moe(cfg, i)
                                                                for i in range(L))
  for leaf in ("router", "gate_up", "down"):
    assert np.any(np.asarray(moe[leaf].get_value()) != 0), f"{variant}: {leaf} grad is 0"
