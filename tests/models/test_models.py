"""Llama / Qwen2 / Qwen3 from Hugging Face folders: against a float64 numpy forward written
here from transformers' modeling semantics, round trips, refused configs, decode == prefill,
batch invariance, and the sampler's log-probs against the trainer's (bitwise)."""

import json
import math
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_bitwise_equal, rel_err

from jaxrl_kernels import models
from jaxrl_kernels._cpu import tree_sum
from jaxrl_kernels.gemm import row_parallel as row_parallel_module
from jaxrl_kernels.nn.sampler import sample, score

V, H, FF, L = 160, 64, 96, 2  # V not a multiple of the 128-wide vocab tile
ARCHS = ("llama", "qwen2", "qwen3")


def _hf_config(arch: str) -> dict:
  cfg = dict(model_type=arch, vocab_size=V, hidden_size=H, intermediate_size=FF,
             num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, torch_dtype="float32")
  if arch == "llama":  # llama3 rotary scaling, biases everywhere, untied head
    cfg.update(rope_theta=500000.0, attention_bias=True, mlp_bias=True,
               tie_word_embeddings=False,
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=16))
  elif arch == "qwen2":  # q/k/v biases, tied embeddings
    cfg.update(rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
               sliding_window=4096, max_window_layers=L)
  else:  # q/k norm, head_dim 32 != hidden / heads = 16, untied
    cfg.update(rope_theta=1000000.0, head_dim=32, attention_bias=False,
               tie_word_embeddings=False)
  return cfg


def _hf_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """Random float32 tensors under transformers' names and layouts (Linear: [out, in])."""
  rng = np.random.default_rng(seed)
  arch = cfg["model_type"]
  hd = cfg.get("head_dim", H // 4)
  nq, nkv = 4 * hd, 2 * hd

  def w(*shape, std=0.15):
    return (rng.standard_normal(shape) * std).astype(np.float32)

  def norm(n):
    return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

  out = {"model.embed_tokens.weight": w(V, H, std=1.0), "model.norm.weight": norm(H)}
  if not cfg["tie_word_embeddings"]:
    out["lm_head.weight"] = w(V, H, std=0.3)
  bias = arch == "qwen2" or cfg.get("attention_bias", False)
  for i in range(L):
    p = f"model.layers.{i}."
    out.update({p + "input_layernorm.weight": norm(H),
                p + "post_attention_layernorm.weight": norm(H),
                p + "self_attn.q_proj.weight": w(nq, H), p + "self_attn.k_proj.weight": w(nkv, H),
                p + "self_attn.v_proj.weight": w(nkv, H), p + "self_attn.o_proj.weight": w(H, nq),
                p + "mlp.gate_proj.weight": w(FF, H), p + "mlp.up_proj.weight": w(FF, H),
                p + "mlp.down_proj.weight": w(H, FF)})
    if bias:
      for n, d in (("q", nq), ("k", nkv), ("v", nkv)):
        out[p + f"self_attn.{n}_proj.bias"] = w(d, std=0.5)
    if arch == "llama" and cfg.get("attention_bias"):
      out[p + "self_attn.o_proj.bias"] = w(H, std=0.5)
    if cfg.get("mlp_bias"):
      for n, d in (("gate", FF), ("up", FF), ("down", H)):
        out[p + f"mlp.{n}_proj.bias"] = w(d, std=0.5)
    if arch == "qwen3":
      out[p + "self_attn.q_norm.weight"] = norm(hd)
      out[p + "self_attn.k_norm.weight"] = norm(hd)
  return out


def _write_st(tensors: dict, path: str) -> None:
  """A safetensors file, written independently of the package's writer."""
  header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
  for name, a in tensors.items():
    b = np.ascontiguousarray(a, "<f4").tobytes()
    header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
    off += len(b)
    blobs.append(b)
  text = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _write_folder(path, cfg: dict, weights: dict, *, shards: int = 1) -> str:
  path = str(path)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)
  if shards == 1:
    _write_st(weights, os.path.join(path, "model.safetensors"))
    return path
  names = sorted(weights)
  weight_map = {}
  for k in range(shards):
    file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: weights[n] for n in names[k::shards]}
    _write_st(part, os.path.join(path, file))
    weight_map.update({n: file for n in part})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
  return path


# ------------------------------------------------------------- float64 reference forward


def _ref_inv_freq(cfg: dict, d: int) -> np.ndarray:
  inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2) / d)
  rs = cfg.get("rope_scaling")
  if not rs:
    return inv
  factor, lo, hi, old = (rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                         rs["original_max_position_embeddings"])
  wavelen = 2 * math.pi / inv
  out = np.where(wavelen > old / lo, inv / factor, inv)
  smooth = (old / wavelen - lo) / (hi - lo)
  mid = (wavelen >= old / hi) & (wavelen <= old / lo)
  return np.where(mid, (1 - smooth) * out / factor + smooth * out, out)


def _ref_logits(cfg: dict, w: dict, tokens: np.ndarray) -> np.ndarray:
  """transformers' Llama/Qwen2/Qwen3 forward in float64: ``[B, T, V]`` logits."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  eps = cfg["rms_norm_eps"]
  nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  hd = cfg.get("head_dim", H // nh)

  def rms(x, g):
    return g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)

  def lin(x, name):
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y

  b, t = tokens.shape
  ang = np.arange(t)[:, None] * _ref_inv_freq(cfg, hd)[None]
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

  def rope(x):  # [B, T, h, d]
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos[None, :, None] + rot * sin[None, :, None]

  x = w["model.embed_tokens.weight"][tokens]
  causal = np.tril(np.ones((t, t), bool))
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = rms(x, w[p + "input_layernorm.weight"])
    q = lin(h, p + "self_attn.q_proj").reshape(b, t, nh, hd)
    k = lin(h, p + "self_attn.k_proj").reshape(b, t, nkv, hd)
    v = lin(h, p + "self_attn.v_proj").reshape(b, t, nkv, hd)
    if cfg["model_type"] == "qwen3":
      q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
    q, k = rope(q), rope(k)
    k, v = np.repeat(k, nh // nkv, axis=2), np.repeat(v, nh // nkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    s = np.where(causal, s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    a = np.einsum("bhqk,bkhd->bqhd", pr, v).reshape(b, t, nh * hd)
    x = x + lin(a, p + "self_attn.o_proj")
    h = rms(x, w[p + "post_attention_layernorm.weight"])
    g = lin(h, p + "mlp.gate_proj")
    x = x + lin(g / (1 + np.exp(-g)) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
  x = rms(x, w["model.norm.weight"])
  head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
  return x @ head.T


# ------------------------------------------------------------------------------ fixtures


_FOLDERS: dict = {}


def _arch_folder(arch: str, tmp_path_factory):
  if arch not in _FOLDERS:
    cfg = _hf_config(arch)
    weights = _hf_weights(cfg, seed=ARCHS.index(arch))
    # qwen2's folder is sharded with an index, the others are single files.
    path = _write_folder(tmp_path_factory.mktemp(arch), cfg, weights,
                         shards=3 if arch == "qwen2" else 1)
    _FOLDERS[arch] = arch, cfg, weights, path
  return _FOLDERS[arch]


@pytest.fixture(scope="module", params=ARCHS)
def arch_folder(request, tmp_path_factory):
  return _arch_folder(request.param, tmp_path_factory)


_TOKENS = np.random.default_rng(5).integers(0, V, (2, 11)).astype(np.int32)


@nnx.jit
def _logits_and_logp(model, tokens):
  targets = jnp.roll(tokens, -1, axis=1)
  return model.logits(tokens), model.logp(tokens, targets, return_entropy=True)


def _check_against_reference(model, cfg, weights):
  ref = _ref_logits(cfg, weights, _TOKENS)
  z, (lp, ent) = _logits_and_logp(model, jnp.asarray(_TOKENS))
  np.testing.assert_allclose(np.asarray(z), ref, rtol=2e-4, atol=2e-4)
  lse = np.log(np.sum(np.exp(ref - ref.max(-1, keepdims=True)), -1)) + ref.max(-1)
  tg = np.roll(_TOKENS, -1, axis=1)
  ref_lp = np.take_along_axis(ref, tg[..., None], -1)[..., 0] - lse
  p = np.exp(ref - lse[..., None])
  np.testing.assert_allclose(np.asarray(lp), ref_lp, rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(np.asarray(ent), lse - np.sum(p * ref, -1), rtol=2e-4, atol=2e-4)


def test_forward_matches_float64_reference(arch_folder):
  arch, cfg, weights, path = arch_folder
  model = models.from_pretrained(path)
  assert model.config.model_type == arch and model.dtype == jnp.float32
  assert model.config.tie_word_embeddings == (arch == "qwen2")
  if arch == "qwen3":
    assert model.config.head_dim == 32 and model.config.qk_norm
  _check_against_reference(model, cfg, weights)


def test_stock_path_matches_float64_reference(arch_folder):
  """implementation='xla' (the benchmarks' baseline: jnp.dot, jax.nn.dot_product_attention,
  materialised logits) computes the same model."""
  _, cfg, weights, path = arch_folder
  _check_against_reference(models.from_pretrained(path, implementation="xla"), cfg, weights)


def _params(model) -> dict:
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_round_trip_same_bits(arch_folder, tmp_path):
  arch, cfg, weights, path = arch_folder
  model = models.from_pretrained(path)
  # Sharded above a size, single file below it.
  for sub, shard_bytes in (("one", 2**30), ("sharded", 40_000)):
    out = tmp_path / sub
    models.save_pretrained(model, out, max_shard_bytes=shard_bytes)
    files = sorted(os.listdir(out))
    if sub == "one":
      assert files == ["config.json", "model.safetensors"]
    else:
      assert "model.safetensors.index.json" in files and len(files) > 3
    again = models.from_pretrained(out)
    assert again.config == model.config
    a, b = _params(model), _params(again)
    assert a.keys() == b.keys()
    for k in a:
      assert_bitwise_equal(b[k], a[k], f"{arch} {k}")
    # The written tensors are the input folder's, name for name, bit for bit.
    written = models.hf.read_safetensors(out / "model.safetensors") if sub == "one" else None
    if written is not None:
      assert set(written) == set(weights)
      for k in weights:
        assert_bitwise_equal(np.asarray(written[k]), weights[k], f"{arch} {k} written")
      with open(out / "config.json") as f:
        saved_cfg = json.load(f)
      assert models.from_hf_dict(saved_cfg) == model.config


def test_bf16_load_and_round_trip(arch_folder, tmp_path):
  _, _, _, path = arch_folder
  model = models.from_pretrained(path, param_dtype="bfloat16")
  assert model.embed_tokens.embedding.get_value().dtype == jnp.bfloat16
  assert model.dtype == jnp.bfloat16
  models.save_pretrained(model, tmp_path)
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  again = models.from_pretrained(tmp_path)
  a, b = _params(model), _params(again)
  for k in a:
    assert_bitwise_equal(b[k], a[k], k)


# --------------------------------------------------------------------------- bad configs


@pytest.mark.parametrize("change, match", [
    (dict(model_type="mistral"), "model_type must be one of"),
    (dict(hidden_act="gelu"), "hidden_act must be 'silu'"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope type 'yarn'"),
    (dict(rope_scaling=dict(type="linear", factor=2.0)), "rope type 'linear'"),
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(mlp_bias=True), "mlp_bias=true is not supported for 'qwen2'"),
    (dict(num_attention_heads=3), "multiple of num_key_value_heads"),
    (dict(vocab_size=None), "'vocab_size' is missing"),
])
def test_bad_config_named_error(tmp_path, change, match):
  cfg = {**_hf_config("qwen2"), **change}
  path = _write_folder(tmp_path, cfg, _hf_weights(_hf_config("qwen2")))
  with pytest.raises(ValueError, match=match):
    models.from_pretrained(path)


def test_llama3_scaling_refused_on_qwen_and_incomplete(tmp_path):
  with pytest.raises(ValueError, match="rope type 'llama3' is not supported for 'qwen3'"):
    models.from_hf_dict({**_hf_config("qwen3"), "rope_scaling": _hf_config("llama")[
        "rope_scaling"]})
  rs = dict(_hf_config("llama")["rope_scaling"])
  del rs["low_freq_factor"]
  with pytest.raises(ValueError, match="needs 'low_freq_factor'"):
    models.from_hf_dict({**_hf_config("llama"), "rope_scaling": rs})


def test_bad_model_arguments(tmp_path):
  cfg = models.config("qwen2.5-0.5b", num_hidden_layers=1, vocab_size=256, hidden_size=64,
                      intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16)
  with pytest.raises(ValueError, match="implementation must be None or one of"):
    models.DecoderLM(cfg, implementation="cudnn", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dtype must be one of"):
    models.DecoderLM(cfg, dtype="int8", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="remat must be a bool"):
    models.DecoderLM(cfg, remat=1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="has no config.json"):
    models.from_pretrained(tmp_path)
  model = models.DecoderLM(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"tokens must be \[B, T\]"):
    model(np.zeros((4,), np.int32))
  with pytest.raises(ValueError, match="positions must have shape"):
    model(np.zeros((1, 4), np.int32), np.zeros((1, 3), np.int32))
  with pytest.raises(ValueError, match="max_docs must be a static int"):
    model(np.zeros((1, 4), np.int32), segment_ids=np.zeros((1, 4), np.int32), max_docs=0)
  with pytest.raises(ValueError, match=r"lengths must lie in \[1, 3\]"):
    model.prefill(np.zeros((1, 3), np.int32), np.array([4]), model.init_cache(1, 8))


def test_transformers_v5_rope_parameters():
  """transformers 5 writes rope_parameters (theta inside) instead of rope_theta/rope_scaling."""
  old = models.from_hf_dict(_hf_config("llama"))
  cfg = _hf_config("llama")
  rp = dict(cfg.pop("rope_scaling"), rope_theta=cfg.pop("rope_theta"))
  assert models.from_hf_dict({**cfg, "rope_parameters": rp}) == old


@pytest.mark.parametrize("what", ["missing", "shape", "unexpected", "no_weights", "shard"])
def test_bad_tensors_named_error(tmp_path, what):
  cfg = _hf_config("qwen3")
  w = _hf_weights(cfg)
  shards = 1
  if what == "missing":
    del w["model.layers.1.self_attn.k_norm.weight"]
    match = r"tensor model.layers.1.self_attn.k_norm.weight \(shape \(32,\)\) is missing"
  elif what == "shape":
    w["model.layers.0.mlp.up_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"][:, :-1]
    match = r"model.layers.0.mlp.up_proj.weight has shape \(96, 63\), expected \(96, 64\)"
  elif what == "unexpected":
    w["model.layers.0.self_attn.o_proj.bias"] = np.zeros(H, np.float32)
    match = "no place for: \\['model.layers.0.self_attn.o_proj.bias'\\]"
  elif what == "shard":
    shards = 2
    match = "lists model-00002-of-00002.safetensors, which is missing"
  else:
    match = "neither model.safetensors nor"
  path = _write_folder(tmp_path, cfg, w, shards=shards)
  if what == "no_weights":
    os.remove(os.path.join(path, "model.safetensors"))
  if what == "shard":
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
  with pytest.raises(ValueError, match=match):
    models.from_pretrained(path)


def test_presets_true_shapes():
  """The presets carry the public configs; parameter counts match the published sizes."""
  counts = {name: models.config(name).num_params() for name in models.PRESETS}
  assert counts["qwen2.5-0.5b"] == 494_032_768
  assert counts["qwen2.5-1.5b"] == 1_543_714_304
  assert counts["llama-3.2-1b"] == 1_235_814_400
  assert counts["llama-3.1-8b"] == 8_030_261_248
  assert counts["qwen3-8b"] == 8_190_735_360
  for name in models.PRESETS:  # the config survives config.json
    cfg = models.config(name)
    assert models.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
  over = dict(num_hidden_layers=1, vocab_size=1024)  # true layer shapes, a small embedding
  small = models.preset("qwen2.5-0.5b", jax.random.key(0), "float32", **over)
  assert models.decoder.num_params(small) == models.config("qwen2.5-0.5b", **over).num_params()
  assert small.config.hidden_size == 896 and small.head.weight_layout == "vh"
  with pytest.raises(ValueError, match="name must be one of"):
    models.config("gpt2")


# ------------------------------------------------------------------- invariance (bitwise)


def test_tree_sum_order_is_shape_free():
  """The RMSNorm reduction: a row's sum is the same bits in every batch shape, and equals
  the pairwise tree written out by hand."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((37, 896)) * np.exp2(rng.integers(-10, 11, (37, 896)))).astype(
      np.float32)
  full = np.asarray(jax.jit(tree_sum)(x))
  for r in (0, 17, 36):
    assert_bitwise_equal(np.asarray(jax.jit(tree_sum)(x[r:r + 1]))[0], full[r], f"row {r}")
  a = np.concatenate([x[3], np.zeros(128, np.float32)])
  while a.size > 1:
    a = a[:a.size // 2] + a[a.size // 2:]
  assert_bitwise_equal(full[3], a[0], "hand-written tree")


# (K, q/k/v widths, kv heads): a toy shape, and Qwen2.5-0.5B's (K = 896, 14/2 heads x 64).
_TOY, _QWEN_05B = (96, (64, 32, 32), 2), (896, (896, 128, 128), 2)


@pytest.mark.parametrize("implementation, shape", [
    ("cpu", _TOY), ("interpret", _TOY),
    pytest.param("triton", _QWEN_05B, marks=pytest.mark.gpu),
    pytest.param("mosaic", _QWEN_05B, marks=pytest.mark.hopper)])
def test_packed_projections_keep_the_bits(implementation, shape):
  """The packed q/k/v and gate/up products (one det_matmul each, biases added after, as
  DetLinear does) give every column the bits of the separate projections' products, at
  1 row and at 15 rows; pack/unpack are exact inverses."""
  from jaxrl_kernels.gemm import det_matmul
  from jaxrl_kernels.models.decoder import pack_gate_up, pack_qkv, unpack_gate_up, unpack_qkv
  k, (nq, nk, nv), hkv = shape
  rng = np.random.default_rng(3)

  def w(*s):
    return (rng.standard_normal(s) * 0.5).astype(jnp.bfloat16)

  def lin(x, kernel, bias):
    return np.asarray(jax.jit(lambda a, b, c: det_matmul(a, b, implementation=implementation)
                              + c)(x, kernel, bias))

  x = jnp.asarray(rng.standard_normal((5, 3, k)), jnp.bfloat16)
  qkv = [(w(k, n), w(n)) for n in (nq, nk, nv)]
  gate_up = [(w(k, 2 * nq), w(2 * nq)) for _ in range(2)]
  packed_qkv = (pack_qkv(*(a for a, _ in qkv), hkv), pack_qkv(*(b for _, b in qkv), hkv))
  packed_gu = (pack_gate_up(*(a for a, _ in gate_up)), pack_gate_up(*(b for _, b in gate_up)))
  for got, want in ((unpack_qkv(packed_qkv[0], hkv, nk // hkv), [a for a, _ in qkv]),
                    (unpack_gate_up(packed_gu[0]), [a for a, _ in gate_up])):
    for g, e in zip(got, want, strict=True):
      assert_bitwise_equal(g, e, "unpack(pack)")
  for rows in (x[:1, :1], x):
    parts = unpack_qkv(lin(rows, *packed_qkv), hkv, nk // hkv)
    for name, part, (kernel, bias) in zip("qkv", parts, qkv, strict=True):
      assert_bitwise_equal(part, lin(rows, kernel, bias), f"{name} of {rows.shape[:2]}")
    parts = unpack_gate_up(lin(rows, *packed_gu))
    for name, part, (kernel, bias) in zip(("gate", "up"), parts, gate_up, strict=True):
      assert_bitwise_equal(part, lin(rows, kernel, bias), f"{name} of {rows.shape[:2]}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  cfg = _hf_config("llama")
  path = _write_folder(tmp_path_factory.mktemp("llama_inv"), cfg, _hf_weights(cfg, seed=9))
  return models.from_pretrained(path)


@nnx.jit
def _prefill(model, tokens, lengths, cache):
  return model.prefill(tokens, lengths, cache)


@nnx.jit
def _decode(model, token, cache):
  return model.decode_step(token, cache)


@nnx.jit(static_argnames=("max_docs",))
def _hidden(model, tokens, positions, segment_ids, max_docs=None):
  return model(tokens, positions, segment_ids, max_docs=max_docs)


def test_decode_equals_prefill_bitwise(llama):
  """Prefill 3 tokens, decode 5 more one at a time, against the full forward."""
  seq = np.random.default_rng(1).integers(0, V, (2, 8)).astype(np.int32)
  full = np.asarray(_hidden(llama, seq, None, None))
  h, cache = _prefill(llama, seq[:, :3], np.array([3, 3], np.int32), llama.init_cache(2, 8))
  assert_bitwise_equal(np.asarray(h), full[:, 2], "prefill")
  for t in range(3, 8):
    h, cache = _decode(llama, seq[:, t], cache)
    assert_bitwise_equal(np.asarray(h), full[:, t], f"decode step {t}")


@pytest.mark.parametrize("k_pad", [0, 16])
def test_decode_with_prepared_weights_keeps_the_bits(llama, k_pad, monkeypatch):
  """The sampler's decode loop form, ``decode_step(..., weights=decode_weights())`` with the
  weights made once outside the steps: bitwise the full forward, as the plain step is.
  ``k_pad=16``: every row-parallel chunk zero-padded (the layout of a chunk K off the K tile
  on Mosaic, forced here on the CPU kernel, forward and decode alike)."""
  if k_pad:
    plan = row_parallel_module._chunk_plan
    monkeypatch.setattr(row_parallel_module, "_chunk_plan", lambda *a: (plan(*a)[0], k_pad))
  weights = nnx.jit(lambda m: m.decode_weights())(llama)
  assert weights is not None and len(weights) == len(llama.layers)
  assert all(w.k_pad == k_pad for pair in weights for w in pair)
  seq = np.random.default_rng(5).integers(0, V, (2, 8)).astype(np.int32)
  full = np.asarray(nnx.jit(lambda m, t: m(t))(llama, seq))
  h, cache = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c))(
      llama, seq[:, :3], np.array([3, 3], np.int32), llama.init_cache(2, 8))
  step = nnx.jit(lambda m, t, c, w: m.decode_step(t, c, weights=w))
  for t in range(3, 8):
    h, cache = step(llama, seq[:, t], cache, weights)
    assert_bitwise_equal(np.asarray(h), full[:, t], f"decode step {t}, k_pad {k_pad}")
  with pytest.raises(ValueError, match="decode_weights"):
    llama.decode_step(seq[:, 0], cache, weights=weights[:1])


def test_logp_batch_and_packing_invariant_bitwise(llama):
  """A sequence's per-token logp: alone, in a batch of 3, and packed with another
  sequence behind a left-padded one (segment_ids + restarting positions)."""
  rng = np.random.default_rng(2)
  seqs = rng.integers(0, V, (3, 7)).astype(np.int32)
  tg = np.roll(seqs, -1, axis=1)
  lp_fn = nnx.jit(lambda m, t, g, p, s: m.logp(t, g, positions=p, segment_ids=s, max_docs=4))
  batch = np.asarray(nnx.jit(lambda m, t, g: m.logp(t, g))(llama, seqs, tg))
  alone = np.asarray(nnx.jit(lambda m, t, g: m.logp(t, g))(llama, seqs[1:2], tg[1:2]))
  assert_bitwise_equal(alone[0], batch[1], "alone vs batch")
  # Row 0: 2 pads then seq 0; row 1: seq 1 (7) then seq 2's first 5 tokens.
  toks = np.zeros((2, 12), np.int32)
  tgts = np.zeros((2, 12), np.int32)
  pos = np.full((2, 12), -1, np.int32)
  seg = np.zeros((2, 12), np.int32)
  toks[0, 2:9], tgts[0, 2:9], pos[0, 2:9] = seqs[0], tg[0], np.arange(7)
  toks[1, :7], tgts[1, :7], pos[1, :7], seg[1, :7] = seqs[1], tg[1], np.arange(7), 1
  toks[1, 7:], tgts[1, 7:], pos[1, 7:], seg[1, 7:] = seqs[2, :5], tg[2, :5], np.arange(5), 2
  packed = np.asarray(lp_fn(llama, toks, tgts, pos, seg))
  assert_bitwise_equal(packed[0, 2:9], batch[0], "left-padded")
  assert_bitwise_equal(packed[1, :7], batch[1], "packed first")
  # seq 2 truncated to 5 tokens: its first 4 predictions see the same prefixes.
  assert_bitwise_equal(packed[1, 7:11], batch[2, :4], "packed second")


@pytest.mark.slow
def test_remat_same_bits_and_gradients(llama):
  seqs = np.random.default_rng(4).integers(0, V, (2, 6)).astype(np.int32)
  tg = np.roll(seqs, -1, axis=1)
  graphdef, state = nnx.split(llama)
  rm = nnx.merge(graphdef, state)
  rm.remat = True

  def loss(m):
    return -jnp.sum(m.logp(seqs, tg))

  l1, g1 = nnx.jit(nnx.value_and_grad(loss))(llama)
  l2, g2 = nnx.jit(nnx.value_and_grad(loss))(rm)
  assert_bitwise_equal(np.asarray(l2), np.asarray(l1), "remat loss")
  for (p, a), (_, b) in zip(nnx.to_flat_state(g1), nnx.to_flat_state(g2), strict=True):
    assert_bitwise_equal(np.asarray(b.get_value()), np.asarray(a.get_value()), f"grad {p}")
  assert all(np.all(np.isfinite(np.asarray(v.get_value()))) for _, v in nnx.to_flat_state(g1))


# ---------------------------------------------------------------- sampler == trainer


# One architecture in CI (untied head, q/k norm); the sampler path of the tied head is
# covered in CI by tests/nn (TinyCausalLM).
@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow),
                                  pytest.param("qwen2", marks=pytest.mark.slow), "qwen3"])
def test_sampler_logp_equals_trainer_logp_bitwise(arch, tmp_path_factory):
  """Sampled at batch 3 with top-k / top-p and a stop id, rescored packed at batch 1."""
  _, _, _, path = _arch_folder(arch, tmp_path_factory)
  model = models.from_pretrained(path)
  rng = np.random.default_rng(11)
  prompts = rng.integers(0, V, (3, 5)).astype(np.int32)
  lens = np.array([5, 2, 4], np.int32)
  res = sample(model, prompts, lens, max_new_tokens=6, key=jax.random.key(3),
               temperature=0.8, top_k=40, top_p=0.9, stop_ids=(7,))
  m = np.asarray(res.completion_mask)
  lp = np.asarray(res.logp)
  assert m.sum() >= 3 and np.all(lp[m] <= 0) and np.all(np.isfinite(lp)) and np.all(lp[~m] == 0)
  got = score(model, res.tokens, res.completion_mask, temperature=0.8, batch_size=1, pack=True)
  assert_bitwise_equal(got, np.asarray(res.logp), f"{arch}: score vs sampler")


# -------------------------------------------------------------------------- gradients


def _packed_rows():
  """Two rows of 64 tokens holding five documents (positions restart, segment ids), the
  last two tokens of row 1 padding."""
  rng = np.random.default_rng(7)
  tokens = rng.integers(0, 256, (2, 64)).astype(np.int32)
  positions = np.full((2, 64), -1, np.int32)
  segments = np.zeros((2, 64), np.int32)
  for r, lengths in enumerate(((20, 30, 14), (40, 22))):
    col = 0
    for seg, n in enumerate(lengths, start=1):
      positions[r, col:col + n] = np.arange(n)
      segments[r, col:col + n] = seg
      col += n
  targets = np.roll(tokens, -1, axis=1)
  mask = (positions >= 0) & (np.roll(positions, -1, axis=1) == positions + 1)
  mask[:, -1] = False
  return tokens, targets, mask, positions, segments


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "llama-3.2-1b", "qwen3-8b"])
def test_training_gradients_match_the_stock_path(preset):
  """Every parameter's gradient of the packed training loss on the kernels' path equals the
  stock XLA path's within float32 tolerance (2 layers; biases, tied or untied head, q/k norm
  by preset), and the gradient reaches q and k: autodiff through the rotary embedding's FMA
  guard (a bitcast through uint32) gave q/k projections an exact zero gradient before the
  guard got its identity derivative."""
  over = dict(num_hidden_layers=2, vocab_size=256, hidden_size=128, intermediate_size=256,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32)
  tokens, targets, mask, positions, segments = _packed_rows()
  grads = {}
  for impl in (None, "xla"):
    model = models.preset(preset, jax.random.key(1), "float32", implementation=impl, **over)

    def loss(m):
      lp = m.logp(tokens, targets, mask, positions=positions, segment_ids=segments, max_docs=5)
      return -jnp.sum(lp) / mask.sum()

    grads[impl] = dict(nnx.to_flat_state(nnx.jit(nnx.grad(loss))(model)))
  assert grads[None].keys() == grads["xla"].keys()
  for path, g in grads[None].items():
    got, want = np.asarray(g.get_value()), np.asarray(grads["xla"][path].get_value())
    assert np.linalg.norm(want) > 0, path
    assert rel_err(got, want) <= 1e-4, (path, rel_err(got, want))
  qkv = [p for p in grads[None] if "qkv_proj" in str(p) and "kernel" in str(p)]
  assert qkv
  for path in qkv:
    q, k, v = models.decoder.unpack_qkv(np.asarray(grads[None][path].get_value()), 2, 32)
    assert min(np.linalg.norm(q), np.linalg.norm(k), np.linalg.norm(v)) > 0, path
