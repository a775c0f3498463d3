"""``TinyCausalLM``: a small pre-norm decoder whose per-token log-probs are batch-invariant.

Embedding -> ``num_layers`` x [RMSNorm -> causal self-attention (rotary) ->
residual -> RMSNorm -> MLP -> residual] -> RMSNorm -> :class:`LMHead`.
Every weight product runs on ``det_matmul`` (``DetLinear``, ``LMHead``); the
attention is plain ``jnp`` for now (a Pallas kernel with a KV-cache decode path
comes with issue 7) but already walks the keys in fixed ``ATTN_KEY_TILE``-wide
tiles in ascending order with a float32 online softmax, skipping a tile with no
visible key exactly, so a query's bits do not depend on how much padding or
how many other sequences surround it (tested bitwise on CPU).

Used by the tests, ``examples/grpo_step.py`` and the demos; sized for the
CPU interpreter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxrl_kernels.nn.linear import DetLinear
from jaxrl_kernels.nn.lm_head import LMHead

# Part of the invariance contract: the key tile fixes which scores are reduced
# together, and so the bits of every attention output.
ATTN_KEY_TILE = 16


@dataclasses.dataclass(frozen=True)
class TinyLMConfig:
  """Shape and numerics of a :class:`TinyCausalLM`.

  Attributes:
    vocab_size, hidden, num_layers, num_heads, mlp_dim: sizes (``hidden`` a
      multiple of ``num_heads``, an even head size).
    rope_base: rotary base frequency.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: the LM head reads the ``[V, H]`` embedding in place.
    fp32_head: the head's projection in float32 (see :class:`LMHead`).
    dtype: parameter and activation dtype (``"float32"`` or ``"bfloat16"``).
    implementation: passed to every deterministic op (None: by device).
  """

  vocab_size: int = 128
  hidden: int = 64
  num_layers: int = 2
  num_heads: int = 4
  mlp_dim: int = 128
  rope_base: float = 10000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  fp32_head: bool = False
  dtype: str = "float32"
  implementation: str | None = None

  def __post_init__(self):
    if self.hidden % self.num_heads or (self.hidden // self.num_heads) % 2:
      raise ValueError(f"TinyLMConfig: hidden={self.hidden} must split into num_heads="
                       f"{self.num_heads} heads of even size")
    if jnp.dtype(self.dtype).name not in ("float32", "bfloat16"):
      raise ValueError(f"TinyLMConfig: dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

  @classmethod
  def preset(cls, name: str, **overrides) -> TinyLMConfig:
    """``"test"`` (V=64, H=32, 1 layer: unit tests), ``"tiny"`` (V=128, H=64, 2
    layers: CPU demos), ``"small"`` (V=512, H=256, 4 layers: GPU)."""
    presets = {
        "test": dict(vocab_size=64, hidden=32, num_layers=1, num_heads=2, mlp_dim=64),
        "tiny": dict(vocab_size=128, hidden=64, num_layers=2, num_heads=4, mlp_dim=128),
        "small": dict(vocab_size=512, hidden=256, num_layers=4, num_heads=8, mlp_dim=1024),
    }
    if name not in presets:
      raise ValueError(f"TinyLMConfig.preset: name must be one of {sorted(presets)}, got {name!r}")
    return cls(**{**presets[name], **overrides})


class RMSNorm(nnx.Module):
  """``y = x / sqrt(mean(x^2) + eps) * scale``, in float32, per row of ``[..., H]``.

  The sum of squares is a strict left-to-right fold over H (:func:`_fold`),
  so a row's bits do not depend on the shape it is computed in.
  """

  def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    ms = (_fold_add(x32 * x32, axis=-1) / jnp.float32(x.shape[-1]))[..., None]
    y = x32 * lax.rsqrt(ms + jnp.float32(self.eps)) * self.scale.value.astype(jnp.float32)
    return y.astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotate-half rotary embedding of ``x [B, T, heads, d]`` at ``positions [B, T]``
  (float32, elementwise: the same bits for a token wherever it is computed)."""
  d = x.shape[-1]
  inv_freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  ang = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, d/2]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : d // 2], x32[..., d // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _fold(op, x: jax.Array, axis: int) -> jax.Array:
  """``op``-reduces ``axis`` strictly left to right. Elementwise ops only: XLA's
  CPU reductions and dots pick their summation order by the whole shape (so by
  the batch and the sequence length); a written-out fold does not."""
  xs = jnp.moveaxis(x, axis, 0)
  out = xs[0]
  for i in range(1, xs.shape[0]):
    out = op(out, xs[i])
  return out


def _fold_add(x: jax.Array, axis: int) -> jax.Array:
  return _fold(jnp.add, x, axis)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     segment_ids: jax.Array) -> jax.Array:
  """Causal attention within segments, ``[B, T, heads, d]`` -> ``[B, T, heads, d]``.

  Query ``i`` sees keys ``j <= i`` with ``segment_ids[j] == segment_ids[i]``.
  Keys are visited in ``ATTN_KEY_TILE``-wide tiles in ascending order; each
  tile gives float32 ``(m, l, acc)`` = (max score, sum of e^(s-m), sum of
  e^(s-m) v), folded into the running state with the online-softmax rule; a
  tile with no visible key is skipped exactly, so keys past a query's sequence
  (padding, later sequences) never touch its bits.
  """
  b, t, nh, d = q.shape
  n = -(-t // ATTN_KEY_TILE)
  pad = n * ATTN_KEY_TILE - t
  q32 = q.astype(jnp.float32) * jnp.float32(1.0 / d ** 0.5)
  k32 = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
  v32 = jnp.pad(v.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
  seg_k = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)
  qi = jnp.arange(t)

  def tile(state, j):
    m, den, acc = state  # [B, heads, T], [B, heads, T], [B, T, heads, d]
    k0 = j * ATTN_KEY_TILE
    kt = lax.dynamic_slice_in_dim(k32, k0, ATTN_KEY_TILE, axis=1)
    vt = lax.dynamic_slice_in_dim(v32, k0, ATTN_KEY_TILE, axis=1)
    st = lax.dynamic_slice_in_dim(seg_k, k0, ATTN_KEY_TILE, axis=1)
    kj = k0 + jnp.arange(ATTN_KEY_TILE)
    vis = (kj[None, :] <= qi[:, None])[None] & (st[:, None, :] == segment_ids[:, :, None])
    s = _fold_add(q32.transpose(0, 2, 1, 3)[:, :, :, None, :]
                  * kt.transpose(0, 2, 1, 3)[:, :, None], axis=-1)  # [B, heads, T, tile]
    s = jnp.where(vis[:, None], s, -jnp.inf)
    mt = _fold(jnp.maximum, s, axis=-1)
    e = jnp.exp(s - jnp.where(jnp.isfinite(mt), mt, 0.0)[..., None])
    lt = _fold_add(e, axis=-1)
    at = _fold_add(e.transpose(0, 2, 1, 3)[..., None]
                   * vt[:, None].transpose(0, 1, 3, 2, 4), axis=3)  # [B, T, heads, d]
    big = jnp.maximum(m, mt)
    a = jnp.exp(jnp.where(den == 0, 0.0, m - big))
    c = jnp.exp(jnp.where(lt == 0, 0.0, mt - big))
    l2 = a * den + c * lt
    acc2 = a.transpose(0, 2, 1)[..., None] * acc + c.transpose(0, 2, 1)[..., None] * at
    take, keep = den == 0, lt == 0  # empty running state / empty tile: exact
    m = jnp.where(take, mt, jnp.where(keep, m, big))
    den_out = jnp.where(take, lt, jnp.where(keep, den, l2))
    take_q, keep_q = (x.transpose(0, 2, 1)[..., None] for x in (take, keep))
    acc = jnp.where(take_q, at, jnp.where(keep_q, acc, acc2))
    return (m, den_out, acc), None

  init = (jnp.full((b, nh, t), -jnp.inf, jnp.float32), jnp.zeros((b, nh, t), jnp.float32),
          jnp.zeros((b, t, nh, d), jnp.float32))
  (_, den, acc), _ = lax.scan(tile, init, jnp.arange(n))
  out = acc / den.transpose(0, 2, 1)[..., None]  # den > 0: every query sees itself
  return out.astype(q.dtype)


class Block(nnx.Module):
  """Pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

  def __init__(self, cfg: TinyLMConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    lin = dict(use_bias=False, param_dtype=dt, implementation=cfg.implementation, rngs=rngs)
    self.cfg = cfg
    self.attn_norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=dt)
    self.qkv = DetLinear(cfg.hidden, 3 * cfg.hidden, **lin)
    self.out = DetLinear(cfg.hidden, cfg.hidden, **lin)
    self.mlp_norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=dt)
    self.up = DetLinear(cfg.hidden, cfg.mlp_dim, **lin)
    self.down = DetLinear(cfg.mlp_dim, cfg.hidden, **lin)

  def __call__(self, x, positions, segment_ids):
    cfg = self.cfg
    b, t, _ = x.shape
    nh, hd = cfg.num_heads, cfg.hidden // cfg.num_heads
    q, k, v = jnp.split(self.qkv(self.attn_norm(x)).reshape(b, t, 3 * nh, hd), 3, axis=2)
    q = rotary(q, positions, cfg.rope_base)
    k = rotary(k, positions, cfg.rope_base)
    x = x + self.out(causal_attention(q, k, v, segment_ids).reshape(b, t, cfg.hidden))
    return x + self.down(jax.nn.silu(self.up(self.mlp_norm(x))))


class TinyCausalLM(nnx.Module):
  """A small decoder whose per-token hidden states and log-probs are batch-invariant.

  ``tokens [B, T]`` -> hidden states ``[B, T, H]``; :meth:`logp` scores given
  ``targets [B, T]`` (usually ``tokens`` shifted left by one) through the fused
  LM head. A token's bits do not depend on the batch size, on right padding,
  or on the other rows (tested bitwise).
  """

  def __init__(self, config: TinyLMConfig, *, rngs: nnx.Rngs):
    cfg = config
    dt = jnp.dtype(cfg.dtype)
    self.config = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, param_dtype=dt, dtype=dt, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=dt)
    self.head = LMHead(cfg.hidden, cfg.vocab_size,
                       tied_embedding=self.embed.embedding if cfg.tie_embeddings else None,
                       fp32_head=cfg.fp32_head, param_dtype=dt,
                       implementation=cfg.implementation, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Hidden states ``[B, T, H]`` after the final norm.

    Args:
      tokens: ``[B, T]`` int ids in ``[0, V)``.
      positions: ``[B, T]`` rotary positions (default ``arange(T)``; restart
        them per document for packed rows).
      segment_ids: ``[B, T]`` int; tokens attend only within their segment
        (default: one segment per row). Right padding needs none (causality).
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
      raise ValueError(f"TinyCausalLM: tokens must be [B, T], got shape {tokens.shape}")
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
      segment_ids = jnp.zeros((b, t), jnp.int32)
    for name, x in (("positions", positions), ("segment_ids", segment_ids)):
      if x.shape != (b, t):
        raise ValueError(f"TinyCausalLM: {name} must have shape {(b, t)}, got {x.shape}")
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, positions, segment_ids)
    return self.final_norm(x)

  def logp(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None, *,
           positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
           temperature: float = 1.0, return_entropy: bool = False):
    """float32 ``log pi(targets | tokens)`` ``[B, T]`` (and entropy) via the fused head."""
    h = self(tokens, positions, segment_ids)
    return self.head(h, targets, mask, temperature=temperature, return_entropy=return_entropy)
