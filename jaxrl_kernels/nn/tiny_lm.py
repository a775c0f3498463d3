"""``TinyCausalLM``: a small pre-norm decoder whose per-token log-probs are batch-invariant,
with a KV-cache decode path that gives the training forward's bits.

Embedding -> ``num_layers`` x [RMSNorm -> causal self-attention (rotary) ->
residual -> RMSNorm -> MLP -> residual] -> RMSNorm -> :class:`LMHead`.

Why a token's bits are the same in every layout (decode one token at a time
at one batch size, or a training forward over padded / packed rows at another):

* weight products run on ``det_matmul`` (``DetLinear``) and the head on
  ``linear_logp``: a row's bits do not depend on the other rows;
* RMSNorm is :class:`jaxrl_kernels.nn.norm.RMSNorm` (a fixed tree over the row, the
  models' norm), rotary is :func:`jaxrl_kernels.nn.rotary.rope` (the models' rotary),
  elementwise from the integer position: the same function of the
  token's own values in every path;
* attention walks key tiles aligned to position 0 of the sequence, so a query
  at position ``p`` depends only on its own ``q`` and keys ``0..p``. The
  training forward therefore hands attention every document *left-aligned*:
  packed and left-padded rows are gathered into one aligned row per document
  (``[num_docs, T]``), attended, and scattered back (data movement only). The
  decode path writes each token's ``k, v`` into the cache at index = position.

Layouts of ``model(tokens, positions, segment_ids)`` (see :meth:`TinyCausalLM.__call__`):
right padding (no arguments), left padding (``positions = arange(T) - pad``,
pads get negative positions), packing (``segment_ids`` and positions
restarting at 0 per document), and any mix.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxrl_kernels.attention import causal_attention
from jaxrl_kernels.nn.linear import DetLinear
from jaxrl_kernels.nn.lm_head import LMHead
from jaxrl_kernels.nn.norm import RMSNorm
from jaxrl_kernels.nn.protocol import Documents as Documents
from jaxrl_kernels.nn.protocol import KVCache as KVCache
from jaxrl_kernels.nn.protocol import (
  check_decode_token,
  check_token_ids,
  embed_ids,
  finish_decode,
)
from jaxrl_kernels.nn.protocol import check_prefill as check_prefill
from jaxrl_kernels.nn.protocol import documents as documents
from jaxrl_kernels.nn.rotary import rope, rope_frequencies

IMPLEMENTATIONS = (None, "triton", "interpret", "xla")


@dataclasses.dataclass(frozen=True)
class TinyLMConfig:
  """Shape and numerics of a :class:`TinyCausalLM`.

  Attributes:
    vocab_size, hidden, num_layers, num_heads, mlp_dim: sizes (``hidden`` a
      multiple of ``num_heads``; the attention kernels need a head size that is a
      multiple of 16 in [16, 256]).
    rope_base: rotary base frequency.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: the LM head reads the ``[V, H]`` embedding in place.
    fp32_head: the head's projection in float32 (see :class:`LMHead`).
    dtype: parameter, activation and KV-cache dtype (``"float32"`` or ``"bfloat16"``).
    implementation: passed to every op: None (the batch-invariant kernels, by
      device), ``"triton"``, ``"interpret"``, or ``"xla"``: the stock XLA path
      of every op (``jnp.dot`` GEMMs, materialised log-softmax, plain softmax
      attention, ``jnp.mean`` RMSNorm) -- the baseline ``jaxrl-kernels parity``
      compares against; not batch-invariant.
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
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"TinyLMConfig: implementation must be one of {IMPLEMENTATIONS}, got "
                       f"{self.implementation!r}")

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


class Block(nnx.Module):
  """Pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

  def __init__(self, cfg: TinyLMConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    lin = dict(use_bias=False, param_dtype=dt, implementation=cfg.implementation, rngs=rngs)
    norm = dict(eps=cfg.norm_eps, param_dtype=dt, implementation=cfg.implementation)
    self.cfg = cfg
    self.attn_norm = RMSNorm(cfg.hidden, **norm)
    self.qkv = DetLinear(cfg.hidden, 3 * cfg.hidden, **lin)
    self.out = DetLinear(cfg.hidden, cfg.hidden, **lin)
    self.mlp_norm = RMSNorm(cfg.hidden, **norm)
    self.up = DetLinear(cfg.hidden, cfg.mlp_dim, **lin)
    self.down = DetLinear(cfg.mlp_dim, cfg.hidden, **lin)

  def _qkv(self, x, positions):
    """``x [B, T, H]`` at ``positions [B, T]`` -> rotated ``q, k``, ``v [B, T, heads, d]``."""
    cfg = self.cfg
    b, t, _ = x.shape
    nh, hd = cfg.num_heads, cfg.hidden // cfg.num_heads
    q, k, v = jnp.split(self.qkv(self.attn_norm(x)).reshape(b, t, 3 * nh, hd), 3, axis=2)
    inv_freq = rope_frequencies(cfg.rope_base, hd)
    guarded = cfg.implementation != "xla"
    return (rope(q, positions, inv_freq, guarded=guarded),
            rope(k, positions, inv_freq, guarded=guarded), v)

  def _attend(self, q, k, v, **kw):
    return causal_attention(q, k, v, implementation=self.cfg.implementation, **kw)

  def _rest(self, x, attn):
    b, t, _ = x.shape
    x = x + self.out(attn.reshape(b, t, self.cfg.hidden))
    return x + self.down(jax.nn.silu(self.up(self.mlp_norm(x))))

  def __call__(self, x, positions, docs: Documents | None):
    """Full-sequence forward; returns the new ``x`` and this layer's ``k, v``."""
    q, k, v = self._qkv(x, positions)
    t = x.shape[1]
    if docs is None:  # every row is one document starting at column 0: already aligned
      attn = self._attend(q, k, v)
    else:
      attn = docs.scatter(self._attend(docs.gather(q), docs.gather(k), docs.gather(v),
                                       q_positions=docs.query_positions(t),
                                       kv_lengths=docs.length))
    return self._rest(x, attn), k, v

  def decode(self, x, cache_k, cache_v, lengths):
    """One token per row ``x [B, 1, H]`` at position ``lengths[b]``: appends its ``k, v``
    to the cache and attends to cache slots ``0..lengths[b]``."""
    q, k, v = self._qkv(x, lengths[:, None])
    rows = jnp.arange(x.shape[0])
    cache_k = cache_k.at[rows, lengths].set(k[:, 0], mode="drop")  # a full row writes nothing
    cache_v = cache_v.at[rows, lengths].set(v[:, 0], mode="drop")
    attn = self._attend(q, cache_k, cache_v, q_positions=lengths[:, None],
                        kv_lengths=lengths + 1)
    return self._rest(x, attn), cache_k, cache_v


class TinyCausalLM(nnx.Module):
  """A small decoder whose per-token hidden states and log-probs are batch-invariant.

  ``tokens [B, T]`` -> hidden states ``[B, T, H]``; :meth:`logp` scores given
  ``targets [B, T]`` (usually ``tokens`` shifted left by one) through the fused
  LM head. A token's bits depend only on its own document's tokens up to it:
  not on the batch size, the padding, the packing, the other rows, or whether
  it came from the full-sequence forward or from :meth:`prefill` /
  :meth:`decode_step` on a KV cache (tested bitwise).

  Jitting: the methods are pure functions of the parameters and their
  arguments (the cache is an explicit pytree, never module state), so wrap
  them in ``nnx.jit`` (e.g. ``nnx.jit(lambda m, t, c: m.decode_step(t, c))``)
  or call them inside ``jax.jit`` on ``nnx.merge(graphdef, state)``.
  """

  def __init__(self, config: TinyLMConfig, *, rngs: nnx.Rngs):
    cfg = config
    dt = jnp.dtype(cfg.dtype)
    self.config = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, param_dtype=dt, dtype=dt, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=dt,
                              implementation=cfg.implementation)
    self.head = LMHead(cfg.hidden, cfg.vocab_size,
                       tied_embedding=self.embed.embedding if cfg.tie_embeddings else None,
                       fp32_head=cfg.fp32_head, param_dtype=dt,
                       implementation=cfg.implementation, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, *, max_docs: int | None = None
               ) -> jax.Array:
    """Hidden states ``[B, T, H]`` after the final norm.

    Supported layouts (mix them freely):

    * right padding: no ``positions``/``segment_ids``; row ``b`` is one document at
      positions ``0..T-1`` (causality keeps the pads out of the real tokens);
    * left padding: ``positions = arange(T) - num_pads[b]``: tokens with a negative
      position are padding (attention output 0; mask them out);
    * packing: documents are runs of one ``segment_ids`` value whose positions go
      ``0, 1, 2, ...``; a position that does not continue the previous token's
      starts a new document, so restarting the positions alone also separates
      documents.

    A document must start at position 0 and positions must increase by one.

    Args:
      tokens: ``[B, T]`` int ids in ``[0, V)``.
      positions: ``[B, T]`` int rotary positions (default ``arange(T)``).
      segment_ids: ``[B, T]`` int (default: all 0).
      max_docs: static bound on the number of documents in the whole batch when
        ``positions`` or ``segment_ids`` is given (default ``B``). Attention runs on
        ``[max_docs, T]`` aligned rows. Too small, or a document not starting at
        position 0: a ValueError for concrete inputs, NaN hidden states for that
        document's tokens under ``jit``.
    """
    tokens = check_token_ids("TinyCausalLM", "tokens", tokens, self.config.vocab_size)
    if tokens.ndim != 2:
      raise ValueError(f"TinyCausalLM: tokens must be [B, T], got shape {tokens.shape}")
    b, t = tokens.shape
    docs = None
    if positions is None and segment_ids is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    else:
      if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
      if segment_ids is None:
        segment_ids = jnp.zeros((b, t), jnp.int32)
      for name, x in (("positions", positions), ("segment_ids", segment_ids)):
        if jnp.shape(x) != (b, t):
          raise ValueError(f"TinyCausalLM: {name} must have shape {(b, t)}, got {jnp.shape(x)}")
      max_docs = b if max_docs is None else max_docs
      if not isinstance(max_docs, int) or max_docs < 1:
        raise ValueError(f"TinyCausalLM: max_docs must be a static int >= 1, got {max_docs!r}")
      docs = documents(jnp.asarray(positions), jnp.asarray(segment_ids), max_docs)
    x = embed_ids(self.embed, tokens, self.config.vocab_size)
    for block in self.blocks:
      x, _, _ = block(x, positions, docs)
    return self.final_norm(x)

  def logp(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None, *,
           positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
           max_docs: int | None = None, temperature: float = 1.0,
           return_entropy: bool = False):
    """float32 ``log pi(targets | tokens)`` ``[B, T]`` (and entropy) via the fused head."""
    h = self(tokens, positions, segment_ids, max_docs=max_docs)
    return self.head(h, targets, mask, temperature=temperature, return_entropy=return_entropy)

  def policy_loss(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
                  *, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                  max_docs: int | None = None, temperature: float = 1.0, **objective):
    """``(loss, metrics)`` of the policy loss fused into the head
    (:meth:`LMHead.policy_loss`); ``metrics["logp"]`` is bitwise :meth:`logp`'s."""
    h = self(tokens, positions, segment_ids, max_docs=max_docs)
    return self.head.policy_loss(h, targets, mask, temperature=temperature, **objective)

  # ---------------------------------------------------------------------------- KV cache

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    """An empty cache for ``batch`` rows of up to ``max_len`` tokens (prompt + completion)."""
    cfg = self.config
    shape = (batch, max_len, cfg.num_heads, cfg.hidden // cfg.num_heads)
    zeros = tuple(jnp.zeros(shape, jnp.dtype(cfg.dtype)) for _ in range(cfg.num_layers))
    return KVCache(zeros, zeros, jnp.zeros((batch,), jnp.int32))

  def prefill(self, tokens: jax.Array, lengths: jax.Array, cache: KVCache
              ) -> tuple[jax.Array, KVCache]:
    """Processes right-padded prompts ``tokens [B, P]`` of ``lengths [B]`` (1 <= lengths <= P).

    Overwrites the cache from position 0 (slots ``>= lengths[b]`` hold the pads'
    keys, never read: decode overwrites them and masks past ``lengths``).

    Returns:
      ``(hidden [B, H], cache)``: the final-norm hidden state of each row's last
      prompt token (position ``lengths[b] - 1``) and the cache with ``lengths``.
    """
    tokens, lengths = check_prefill("TinyCausalLM.prefill", tokens, lengths, cache,
                                    self.config.vocab_size)
    b, p = tokens.shape
    x = embed_ids(self.embed, tokens, self.config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    keys, values = [], []
    for block, ck, cv in zip(self.blocks, cache.keys, cache.values):
      x, k, v = block(x, positions, None)
      keys.append(lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, 0, 0, 0)))
      values.append(lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, 0, 0, 0)))
    h = self.final_norm(x)[jnp.arange(b), lengths - 1]
    return h, KVCache(tuple(keys), tuple(values), lengths)

  def decode_step(self, token: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Appends ``token [B]`` at position ``cache.lengths[b]`` of each row.

    Returns ``(hidden [B, H], cache)`` with ``lengths + 1``. A row whose cache is
    full (``lengths[b] == max_len``) writes nothing, keeps its length and gets a
    NaN hidden state (size the cache for prompt + completion: ``sample`` does).
    """
    token = check_decode_token("TinyCausalLM.decode_step", token, cache, self.config.vocab_size)
    lengths = cache.lengths
    x = embed_ids(self.embed, token[:, None], self.config.vocab_size)
    keys, values = [], []
    for block, ck, cv in zip(self.blocks, cache.keys, cache.values):
      x, ck, cv = block.decode(x, ck, cv, lengths)
      keys.append(ck)
      values.append(cv)
    h = self.final_norm(x)[:, 0]
    return finish_decode(h, cache, keys, values)
