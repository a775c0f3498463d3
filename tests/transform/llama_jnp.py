"""A small Llama-style model in plain jnp, written as a user would write it (not with
the library's modules): the model that ``batch_invariant`` is proven on.

Embedding lookup, RMSNorm via ``jnp.mean``, RoPE, grouped-query attention by
``jnp.repeat`` with ``jnp.einsum`` scores and a float32 ``jax.nn.softmax`` (or, with
``attention="sdpa"``, ``jax.nn.dot_product_attention``: ``is_causal`` in the forward,
``key_value_seq_lengths`` against the cache in decode), SwiGLU, an untied LM head.
``decode_logits`` runs the model one token at a time against a zero-initialised KV
cache written with ``lax.dynamic_update_slice`` inside a ``lax.fori_loop``;
``generate`` is the greedy decoder. ``build`` is the model in the
``jaxrl-kernels parity --model-fn llama_jnp:build`` protocol (docs/transform.md).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab: int = 97
  dim: int = 32
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  ffn: int = 64
  max_len: int = 40
  rope_theta: float = 10000.0
  dtype: str = "float32"
  # "einsum", "sdpa" (jax.nn.dot_product_attention) or "cudnn" (the same, implementation="cudnn")
  attention: str = "einsum"

  @property
  def head_dim(self) -> int:
    return self.dim // self.n_heads


def init(key, cfg: LlamaConfig) -> dict:
  """Parameters: normal weights scaled by 1/sqrt(fan_in), unit norm gains."""
  dt = jnp.dtype(cfg.dtype)
  hd = cfg.head_dim

  def w(k, shape):
    return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(shape[0])).astype(dt)

  keys = iter(jax.random.split(key, 3 + 7 * cfg.n_layers))
  layers = []
  for _ in range(cfg.n_layers):
    layers.append({
        "attn_norm": jnp.ones((cfg.dim,), dt),
        "wq": w(next(keys), (cfg.dim, cfg.n_heads * hd)),
        "wk": w(next(keys), (cfg.dim, cfg.n_kv_heads * hd)),
        "wv": w(next(keys), (cfg.dim, cfg.n_kv_heads * hd)),
        "wo": w(next(keys), (cfg.n_heads * hd, cfg.dim)),
        "mlp_norm": jnp.ones((cfg.dim,), dt),
        "w1": w(next(keys), (cfg.dim, cfg.ffn)),
        "w3": w(next(keys), (cfg.dim, cfg.ffn)),
        "w2": w(next(keys), (cfg.ffn, cfg.dim)),
    })
  return {
      "embed": (jax.random.normal(next(keys), (cfg.vocab, cfg.dim), jnp.float32)).astype(dt),
      "layers": layers,
      "final_norm": jnp.ones((cfg.dim,), dt),
      "lm_head": w(next(keys), (cfg.dim, cfg.vocab)),
  }


def rms_norm(x, gain, eps: float = 1e-5):
  xf = x.astype(jnp.float32)
  ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
  return (xf * lax.rsqrt(ms + eps)).astype(x.dtype) * gain


def rope(x, pos, theta: float):
  """Rotary embedding of ``x [B, T, heads, hd]`` at integer positions ``pos [B, T]``."""
  hd = x.shape[-1]
  freqs = theta ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  ang = pos.astype(jnp.float32)[..., None, None] * freqs  # [B, T, 1, hd/2]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)


def attention(q, k, v, mask, cfg: LlamaConfig, kv_lengths=None):
  """``q [B, T, H, hd]``, ``k, v [B, S, KV, hd]``, ``mask [B, T, S]`` (True: attend).

  ``attention="sdpa"`` (``"cudnn"``): ``jax.nn.dot_product_attention`` (with
  ``implementation="cudnn"``), causal when ``kv_lengths``
  is None (the full forward, ``S == T``), else over the first ``kv_lengths [B]`` keys
  (decode against the cache).
  """
  if cfg.attention in ("sdpa", "cudnn"):
    impl = "cudnn" if cfg.attention == "cudnn" else None
    if kv_lengths is None:
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths,
                                        implementation=impl)
  rep = cfg.n_heads // cfg.n_kv_heads
  k = jnp.repeat(k, rep, axis=2)
  v = jnp.repeat(v, rep, axis=2)
  scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
  scores = scores / math.sqrt(cfg.head_dim)
  scores = jnp.where(mask[:, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bhts,bshd->bthd", probs, v)


def _block(layer, x, pos, kv, mask, cfg: LlamaConfig, kv_lengths=None):
  """One layer on ``x [B, T, D]``; ``kv(k, v) -> (k_all, v_all)`` supplies the keys."""
  b, t, _ = x.shape
  h = rms_norm(x, layer["attn_norm"])
  q = (h @ layer["wq"]).reshape(b, t, cfg.n_heads, cfg.head_dim)
  k = (h @ layer["wk"]).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
  v = (h @ layer["wv"]).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
  q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
  k_all, v_all = kv(k, v)
  a = attention(q, k_all, v_all, mask, cfg, kv_lengths).reshape(b, t, cfg.dim)
  x = x + a @ layer["wo"]
  h = rms_norm(x, layer["mlp_norm"])
  return x + (jax.nn.silu(h @ layer["w1"]) * (h @ layer["w3"])) @ layer["w2"]


def _head(params, x):
  h = rms_norm(x, params["final_norm"])
  return jnp.einsum("btd,dv->btv", h, params["lm_head"], preferred_element_type=jnp.float32)


def forward(params, tokens, cfg: LlamaConfig):
  """Logits ``[B, T, V]`` (float32) of the full causal forward over ``tokens [B, T]``."""
  b, t = tokens.shape
  x = params["embed"][tokens]
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  for layer in params["layers"]:
    x = _block(layer, x, pos, lambda k, v: (k, v), mask, cfg)
  return _head(params, x)


def init_cache(batch: int, cfg: LlamaConfig) -> dict:
  shape = (cfg.n_layers, batch, cfg.max_len, cfg.n_kv_heads, cfg.head_dim)
  return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}


def decode_step(params, cache, token, step, cfg: LlamaConfig):
  """One token ``token [B]`` at position ``step``: logits ``[B, V]`` and the new cache."""
  b = token.shape[0]
  x = params["embed"][token][:, None]
  pos = jnp.full((b, 1), step)
  mask = jnp.broadcast_to(jnp.arange(cfg.max_len) <= step, (b, 1, cfg.max_len))
  ks, vs = [], []
  for i, layer in enumerate(params["layers"]):
    def kv(k, v, i=i):
      k_all = lax.dynamic_update_slice(cache["k"][i], k, (0, step, 0, 0))
      v_all = lax.dynamic_update_slice(cache["v"][i], v, (0, step, 0, 0))
      ks.append(k_all)
      vs.append(v_all)
      return k_all, v_all
    x = _block(layer, x, pos, kv, mask, cfg, jnp.full((b,), step + 1, jnp.int32))
  return _head(params, x)[:, 0], {"k": jnp.stack(ks), "v": jnp.stack(vs)}


def decode_logits(params, tokens, cfg: LlamaConfig):
  """Logits ``[B, T, V]`` produced one token at a time (teacher forcing) by a
  ``fori_loop`` over positions against a zero-initialised cache."""
  b, t = tokens.shape

  def body(i, carry):
    cache, out = carry
    logits, cache = decode_step(params, cache, tokens[:, i], i, cfg)
    return cache, lax.dynamic_update_slice(out, logits[:, None], (0, i, 0))

  out = jnp.zeros((b, t, cfg.vocab), jnp.float32)
  return lax.fori_loop(0, t, body, (init_cache(b, cfg), out))[1]


def generate(params, prompt, steps: int, cfg: LlamaConfig):
  """Greedy decoding: feeds ``prompt [B, P]`` then ``steps`` argmax tokens; returns the
  ``[B, P + steps]`` tokens and the ``[B, P + steps - 1, V]`` logits that chose them."""
  b, p = prompt.shape
  total = p + steps
  toks = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompt)

  def body(i, carry):
    cache, toks, out = carry
    logits, cache = decode_step(params, cache, toks[:, i], i, cfg)
    nxt = jnp.where(i + 1 < p, toks[:, i + 1], jnp.argmax(logits, -1).astype(jnp.int32))
    toks = lax.dynamic_update_slice(toks, nxt[:, None], (0, i + 1))
    return cache, toks, lax.dynamic_update_slice(out, logits[:, None], (0, i, 0))

  out = jnp.zeros((b, total - 1, cfg.vocab), jnp.float32)
  _, toks, out = lax.fori_loop(0, total - 1, body, (init_cache(b, cfg), toks, out))
  return toks, out


def loss(params, tokens, cfg: LlamaConfig):
  """Mean next-token cross entropy."""
  logits = forward(params, tokens[:, :-1], cfg)
  logp = jax.nn.log_softmax(logits, axis=-1)
  tgt = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return -jnp.mean(tgt)


@dataclasses.dataclass(frozen=True)
class LlamaModel:
  """The parity protocol's model (docs/transform.md): ``forward``, ``init_cache``,
  ``decode`` of plain arrays; the cache has ``max_len`` slots."""

  cfg: LlamaConfig

  def forward(self, params, tokens):
    return forward(params, tokens, self.cfg)

  def init_cache(self, params, batch: int, max_len: int):
    del params
    return init_cache(batch, dataclasses.replace(self.cfg, max_len=max_len))

  def decode(self, params, cache, token, position):
    cfg = dataclasses.replace(self.cfg, max_len=cache["k"].shape[2])
    return decode_step(params, cache, token, position, cfg)


def build(seed: int, **config) -> tuple[dict, LlamaModel]:
  """``(params, model)`` of a small Llama (``LlamaConfig(**config)``) from ``seed``."""
  cfg = LlamaConfig(**config)
  return init(jax.random.key(seed), cfg), LlamaModel(cfg)


def build_sdpa(seed: int) -> tuple[dict, LlamaModel]:
  """``build`` with ``jax.nn.dot_product_attention`` for the attention."""
  return build(seed, attention="sdpa")
