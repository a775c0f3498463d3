"""``DecoderLM``: the Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral decoder on the
batch-invariant ops.

``tokens -> embed -> L x [x + o(attn(rope(q), rope(k), v)) on RMSNorm(x);
x + down(silu(gate(h)) * up(h)) on h = RMSNorm(x)] -> RMSNorm -> LM head``,
the forward of ``transformers``' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` (Qwen2: q/k/v biases; Qwen3: RMSNorm over ``head_dim`` of
q and k before rotary; Llama: optional ``attention_bias`` / ``mlp_bias`` and
``llama3`` rotary scaling). Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3's attention) and
Mixtral (``MixtralForCausalLM``: Llama's attention) replace the MLP of their MoE layers
(``DecoderConfig.is_moe_layer``) by :class:`MoEMLP`, a dropless
:func:`jaxrl_kernels.moe.moe_mlp` whose routing is row-local: a token's bits stay
independent of the batch.

Why a token's bits are the same in every layout (decode at one batch size,
the training forward packed at another), as for :class:`~jaxrl_kernels.nn.TinyCausalLM`:

* every projection runs on ``det_matmul`` (:class:`~jaxrl_kernels.nn.DetLinear`),
  the head on ``linear_logp`` (:class:`~jaxrl_kernels.nn.LMHead`): a row's bits
  do not depend on the other rows;
* ``o_proj`` and ``down_proj`` (the layers a tensor-parallel model splits over
  their K axis) reduce K in the canonical row-parallel order of
  :func:`~jaxrl_kernels.gemm.row_parallel_matmul`: contiguous K chunks
  (``row_parallel_chunks``, by default :func:`canonical_row_chunks`), each a float32
  ``det_matmul``, summed by a fixed pairwise tree. A model sharded over any TP degree
  dividing them (:func:`jaxrl_kernels.models.shard`) reduces in the same order, so its
  bits are these;
* RMSNorm (:func:`jaxrl_kernels.nn.rms_norm`, one kernel on a GPU) sums the squares by a
  fixed pairwise tree over the feature axis (``log2 H`` halvings, the same order for
  every shape); a decode step finishes each row-parallel layer's residual add in the
  norm after it (``nn.add_rms_norm``, the same bits); rotary is elementwise from the
  integer position;
* attention is ``causal_attention`` on documents left-aligned at key 0
  (``nn.protocol.documents``), and decode writes each token's ``k, v`` at
  index = position: fixed key tiles from key 0 give decode == prefill.

``implementation="xla"`` is the stock path the benchmarks compare against:
``jnp.dot`` projections, ``jax.nn.dot_product_attention`` (cuDNN on GPUs for
bf16/fp16), ``jnp.mean`` RMSNorm and materialised logits; not batch-invariant.

Parameters (``nnx.Param``, plain arrays) carry a ``logical_axes`` metadata
entry naming each dimension (``"vocab"``, ``"embed"``, ``"q_heads"``,
``"kv_heads"``, ``"mlp"``, ``"head_dim"``), for a sharding rule to map onto a mesh.

Sibling projections are stored packed, one product each (as XLA merges them on the
stock path): ``self_attn.qkv_proj`` holds ``q/k/v_proj`` with its columns grouped per
KV head, ``[H, Hkv, G + 2, d]`` flattened (a KV head's ``G`` query heads, then its key
head, then its value head), and ``mlp.gate_up_proj`` holds ``gate/up_proj`` with
their columns interleaved, ``[H, I, 2]`` flattened. A contiguous slice of either
column axis is whole GQA groups (whole gate/up pairs), so tensor parallelism splits
them as it splits heads. ``det_matmul`` reduces each column in one order whatever
N is and wherever the column sits, so the packed products have the bits of the
separate ones (``tests/models/test_models.py::test_packed_projections_keep_the_bits``);
a decode step runs 4 products per layer instead of 7. :mod:`~jaxrl_kernels.models.hf`
packs ``transformers``' separate tensors on load and splits them on save
(:func:`pack_qkv`, :func:`pack_gate_up` and their inverses).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxrl_kernels import _backend, contract
from jaxrl_kernels._validation import as_temperature
from jaxrl_kernels.attention import causal_attention
from jaxrl_kernels.gemm import (
  ChunkedWeight,
  chunk_weight,
  det_matmul,
  row_parallel_matmul,
  row_parallel_partials,
)
from jaxrl_kernels.models.config import DecoderConfig, parse_dtype
from jaxrl_kernels.moe import load_balancing_loss, moe_mlp
from jaxrl_kernels.nn.linear import DetLinear
from jaxrl_kernels.nn.lm_head import LMHead
from jaxrl_kernels.nn.norm import RMSNorm
from jaxrl_kernels.nn.protocol import (
  Documents,
  KVCache,
  check_decode_token,
  check_prefill,
  check_token_ids,
  documents,
  embed_ids,
  finish_decode,
  is_traced,
)
from jaxrl_kernels.nn.rotary import rope

_INIT_STD = 0.02  # transformers' initializer_range default, for random (preset) weights


@functools.cache
def _inv_freq(config: DecoderConfig) -> np.ndarray:
  return config.inv_freq()


def pack_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, num_kv_heads: int) -> np.ndarray:
  """``q [..., Hq * d]``, ``k, v [..., Hkv * d]`` (columns of the separate projections,
  a kernel's last axis or a bias) -> ``[..., Hkv * (G + 2) * d]``, grouped per KV head."""
  lead = q.shape[:-1]
  d = k.shape[-1] // num_kv_heads
  parts = [q.reshape(*lead, num_kv_heads, -1, d), k.reshape(*lead, num_kv_heads, 1, d),
           v.reshape(*lead, num_kv_heads, 1, d)]
  return np.concatenate(parts, axis=-2).reshape(*lead, -1)


def unpack_qkv(qkv: np.ndarray, num_kv_heads: int, head_dim: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The inverse of :func:`pack_qkv`."""
  lead = qkv.shape[:-1]
  y = qkv.reshape(*lead, num_kv_heads, -1, head_dim)
  return (y[..., :-2, :].reshape(*lead, -1), y[..., -2, :].reshape(*lead, -1),
          y[..., -1, :].reshape(*lead, -1))


def pack_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
  """``gate, up [..., I]`` -> ``[..., 2 I]``, the columns interleaved (gate, up)."""
  return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def unpack_gate_up(gate_up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The inverse of :func:`pack_gate_up`."""
  return gate_up[..., 0::2], gate_up[..., 1::2]


def _linear(din, dout, axes, *, bias, dtype, param_dtype, implementation, rngs):
  layer = DetLinear(din, dout, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                    kernel_init=nnx.initializers.normal(_INIT_STD),
                    implementation=implementation, rngs=rngs)
  layer.kernel.set_metadata(logical_axes=axes)
  if bias:
    layer.bias.set_metadata(logical_axes=axes[1:])
  return layer


class RowParallelLinear(nnx.Module):
  """``y = x @ kernel + bias`` with K reduced in the canonical row-parallel order.

  The parameters are :class:`~jaxrl_kernels.nn.DetLinear`'s (``kernel [in, out]``,
  ``bias [out]``, the same initialisers and names), so checkpoints do not change.
  The product is :func:`row_parallel_matmul` with ``chunks`` K chunks: float32
  partials of contiguous K chunks, a fixed pairwise tree over them, ``+ bias`` in
  float32, one rounding to ``dtype``. ``axis_name`` (set by
  :func:`jaxrl_kernels.models.shard` on its own copy of the model) makes the layer
  row-parallel inside ``shard_map``: this device holds a contiguous slice of K and
  the partials are combined by the same tree (``merge="canonical"``), or by a
  ``psum`` (``merge="psum"``, the Megatron layer, whose bits depend on the TP
  degree). ``chunks=1`` outside ``shard_map``, and ``implementation="xla"`` (the
  stock path), compute ``DetLinear``'s ``det_matmul(x, kernel) + bias`` instead.
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype,
               param_dtype, chunks: int, implementation: str | None, rngs: nnx.Rngs):
    self.in_features = in_features
    self.out_features = out_features
    self.dtype = dtype
    self.chunks = chunks
    self.implementation = implementation
    self.axis_name: str | None = None
    self.merge = "canonical"
    self.kernel = nnx.Param(nnx.initializers.normal(_INIT_STD)(
        rngs.params(), (in_features, out_features), param_dtype))
    # One key per parameter, as DetLinear draws them: preset weights do not change.
    self.bias = (nnx.Param(nnx.initializers.zeros_init()(rngs.params(), (out_features,),
                                                         param_dtype))
                 if use_bias else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [..., in]`` (this device's K slice inside ``shard_map``) -> ``[..., out]`` in
    ``dtype``."""
    dtype = self.dtype
    kernel = self.kernel[...].astype(dtype)
    bias = None if self.bias is None else self.bias[...].astype(dtype)
    x = x.astype(dtype)
    if self.axis_name is None and (self.chunks == 1 or self.implementation == "xla"):
      y = det_matmul(x, kernel, implementation=self.implementation)
      return y if bias is None else y + bias
    return row_parallel_matmul(x, kernel, bias, axis_name=self.axis_name, chunks=self.chunks,
                               merge=self.merge, implementation=self.implementation)

  def _gives_partials(self) -> bool:
    return not (self.axis_name is not None or self.chunks == 1 or self.implementation == "xla")

  def partials(self, x: jax.Array, kernel: ChunkedWeight | None = None
               ) -> tuple[jax.Array, jax.Array | None] | None:
    """``(P, bias)``: the float32 chunk partials ``P [chunks, ..., out]`` of this layer's
    product (:func:`row_parallel_partials`), for a consumer that finishes them
    (``RMSNorm.add``); None where the layer does not run the unsharded canonical chunks
    (inside ``shard_map``, ``chunks=1``, the stock path): call the layer instead.
    ``kernel``: this layer's :meth:`chunked_kernel`, made once outside a decode loop (the
    same bits, forward only)."""
    if not self._gives_partials():
      return None
    dtype = self.dtype
    bias = None if self.bias is None else self.bias[...].astype(dtype)
    w = self.kernel[...].astype(dtype) if kernel is None else kernel
    return (row_parallel_partials(x.astype(dtype), w, chunks=self.chunks,
                                  implementation=self.implementation), bias)

  def chunked_kernel(self) -> ChunkedWeight | None:
    """The kernel in :meth:`partials`' chunk layout (``gemm.chunk_weight``), or None where
    :meth:`partials` is None."""
    if not self._gives_partials():
      return None
    return chunk_weight(self.kernel[...].astype(self.dtype), chunks=self.chunks,
                        implementation=self.implementation)


def _row_linear(din, dout, axes, *, bias, dtype, param_dtype, chunks, implementation, rngs):
  layer = RowParallelLinear(din, dout, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                            chunks=chunks, implementation=implementation, rngs=rngs)
  layer.kernel.set_metadata(logical_axes=axes)
  if bias:
    layer.bias.set_metadata(logical_axes=axes[1:])
  return layer


def _stock_attention(q, k, v, kv_lengths, *, causal: bool, q_lengths=None):
  """``jax.nn.dot_product_attention``: cuDNN on a GPU for bf16/fp16 where it takes the
  shapes (it checks them while tracing), else XLA. ``q_lengths``: queries at or past it
  are padding (``query_seq_lengths``)."""
  # An empty document slot (length 0) would softmax over no key: give it one (its rows
  # are never read back).
  kv_lengths = jnp.maximum(kv_lengths.astype(jnp.int32), 1)
  kw = dict(is_causal=causal, key_value_seq_lengths=kv_lengths)
  if q_lengths is not None:
    kw["query_seq_lengths"] = jnp.maximum(q_lengths.astype(jnp.int32), 1)
  if _backend.platform() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
    try:
      return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
    except (NotImplementedError, ValueError, RuntimeError):
      pass  # a shape or version cuDNN does not take: the XLA form below
  return jax.nn.dot_product_attention(q, k, v, **kw)


class Attention(nnx.Module):
  """GQA self-attention: ``qkv_proj`` (packed, see the module docstring), optional
  ``q_norm``/``k_norm``, rotary, ``o_proj``."""

  def __init__(self, cfg: DecoderConfig, *, dtype, param_dtype, implementation, row_chunks,
               rngs):
    lin = dict(dtype=dtype, param_dtype=param_dtype, implementation=implementation, rngs=rngs)
    h = cfg.hidden_size
    self.cfg = cfg
    self.implementation = implementation
    # Columns [Hkv, G + 2, d]: split over "kv_heads", a slice is whole GQA groups.
    self.qkv_proj = _linear(h, cfg.q_dim + 2 * cfg.kv_dim, ("embed", "kv_heads"),
                            bias=cfg.attention_bias, **lin)
    o_bias = cfg.attention_bias and cfg.model_type == "llama"
    self.o_proj = _row_linear(cfg.q_dim, h, ("q_heads", "embed"), bias=o_bias,
                              chunks=row_chunks, **lin)
    if cfg.qk_norm:
      norm = dict(eps=cfg.rms_norm_eps, param_dtype=param_dtype, implementation=implementation,
                  axis_name="head_dim")
      self.q_norm = RMSNorm(cfg.head_dim, **norm)
      self.k_norm = RMSNorm(cfg.head_dim, **norm)
    else:
      self.q_norm = self.k_norm = None

  def qkv(self, x: jax.Array, positions: jax.Array):
    """``x [B, T, H]`` (normed) at ``positions [B, T]`` -> rotated ``q [B, T, Hq, d]``,
    ``k, v [B, T, Hkv, d]`` (under tensor parallelism: this device's heads, as many as
    its q/k/v kernels hold)."""
    cfg = self.cfg
    b, t, _ = x.shape
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    y = self.qkv_proj(x).reshape(b, t, -1, group + 2, cfg.head_dim)
    q = y[:, :, :, :group].reshape(b, t, -1, cfg.head_dim)
    k, v = y[:, :, :, group], y[:, :, :, group + 1]
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = _inv_freq(cfg)
    guarded = self.implementation != "xla"
    return (rope(q, positions, inv_freq, guarded=guarded),
            rope(k, positions, inv_freq, guarded=guarded), v)

  def attend(self, q, k, v, *, q_positions=None, kv_lengths=None, docs: Documents | None = None):
    """Causal attention of ``q`` on keys from position 0 (see ``causal_attention``).
    ``docs``: ``q, k, v`` are its aligned rows (``Documents.gather``): each row's queries
    past its document's length are padding and cost nothing."""
    if docs is not None:
      kv_lengths = docs.length
    if self.implementation == "xla":
      b, s = k.shape[:2]
      kv_lengths = jnp.full((b,), s, jnp.int32) if kv_lengths is None else kv_lengths
      # Decode: one query at position kv_lengths - 1 sees every key below kv_lengths.
      return _stock_attention(q, k, v, kv_lengths, causal=q_positions is None,
                              q_lengths=None if docs is None else docs.length)
    if docs is not None:
      q_positions = docs.query_positions(q.shape[1])
    return causal_attention(q, k, v, q_positions=q_positions, kv_lengths=kv_lengths,
                            scale=self.cfg.head_dim ** -0.5, implementation=self.implementation)

  def out(self, attn: jax.Array) -> jax.Array:
    b, t = attn.shape[:2]
    return self.o_proj(attn.reshape(b, t, -1))


class MLP(nnx.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))`` (``silu(g) * u`` in float32, one rounding);
  ``gate_up_proj`` holds gate and up packed (columns interleaved, see the module
  docstring)."""

  def __init__(self, cfg: DecoderConfig, *, dtype, param_dtype, implementation, row_chunks,
               rngs):
    lin = dict(bias=cfg.mlp_bias, dtype=dtype, param_dtype=param_dtype,
               implementation=implementation, rngs=rngs)
    h, i = cfg.hidden_size, cfg.intermediate_size
    # Columns [I, 2]: split over "mlp", a slice is whole (gate, up) pairs.
    self.gate_up_proj = _linear(h, 2 * i, ("embed", "mlp"), **lin)
    self.down_proj = _row_linear(i, h, ("mlp", "embed"), chunks=row_chunks, **lin)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(self.hidden(x))

  def hidden(self, x: jax.Array) -> jax.Array:
    """``silu(gate(x)) * up(x)``, the input of ``down_proj``."""
    y = self.gate_up_proj(x)
    g, u = y[..., 0::2], y[..., 1::2]
    act = jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)
    return act.astype(g.dtype)


class MoEMLP(nnx.Module):
  """A mixture-of-experts SwiGLU layer (:func:`jaxrl_kernels.moe.moe_mlp`): ``router [H,
  E]``, the experts' ``gate_up [E, H, 2 I]`` (gate and up columns interleaved, as
  ``MLP.gate_up_proj``) and ``down [E, I, H]``, ``I = moe_intermediate_size``. The router
  product runs in the activation dtype, its softmax in float32 (``transformers``)."""

  def __init__(self, cfg: DecoderConfig, *, dtype, param_dtype, implementation, rngs):
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    init = nnx.initializers.normal(_INIT_STD)
    self.dtype = dtype
    self.implementation = implementation
    self.k = cfg.num_experts_per_tok
    self.normalize = bool(cfg.norm_topk_prob)
    self.router = nnx.Param(init(rngs.params(), (h, e), param_dtype))
    # The router is whole on every device ("router" is no tensor-parallel axis).
    self.router.set_metadata(logical_axes=("embed", "router"))
    self.gate_up = nnx.Param(init(rngs.params(), (e, h, 2 * i), param_dtype))
    self.gate_up.set_metadata(logical_axes=("expert", "embed", "mlp"))
    self.down = nnx.Param(init(rngs.params(), (e, i, h), param_dtype))
    self.down.set_metadata(logical_axes=("expert", "mlp", "embed"))

  #: Set by ``models.shard`` to its tensor-parallel axis: the experts split over it, the
  #: tokens replicated (``moe_mlp``'s ``expert_axis``, ``tokens_replicated``).
  expert_axis: str | None = None

  def route(self, x: jax.Array):
    """``x [..., H]`` -> :class:`~jaxrl_kernels.moe.MoEOutput` (``y [..., H]`` in
    ``dtype``; the router's float32 ``logits``, ``probs [T, E]`` and ``experts [T, k]``)."""
    dt = self.dtype
    return moe_mlp(x.astype(dt), self.router[...].astype(dt), self.gate_up[...].astype(dt),
                   self.down[...].astype(dt), k=self.k, normalize=self.normalize,
                   implementation=self.implementation, expert_axis=self.expert_axis,
                   tokens_replicated=self.expert_axis is not None)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.route(x).y


class DecoderLayer(nnx.Module):
  """``x + attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``;
  ``mlp`` an :class:`MLP`, or a :class:`MoEMLP` where ``cfg.is_moe_layer(index)``."""

  def __init__(self, cfg: DecoderConfig, *, dtype, param_dtype, implementation, row_chunks,
               rngs, index: int = 0):
    # row_chunks: (o_proj's, down_proj's) K chunks.
    kw = dict(dtype=dtype, param_dtype=param_dtype, implementation=implementation, rngs=rngs)
    norm = dict(eps=cfg.rms_norm_eps, param_dtype=param_dtype, implementation=implementation)
    self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
    self.self_attn = Attention(cfg, row_chunks=row_chunks[0], **kw)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
    self.moe = cfg.is_moe_layer(index)
    self.mlp = MoEMLP(cfg, **kw) if self.moe else MLP(cfg, row_chunks=row_chunks[1], **kw)

  def _rest(self, x, attn):
    return self._rest_routed(x, attn)[0]

  def _rest_routed(self, x, attn):
    """``(x, routing)``: routing is ``(probs, experts)`` of a MoE layer, else None."""
    x = x + self.self_attn.out(attn)
    h = self.post_attention_layernorm(x)
    if not self.moe:
      return x + self.mlp(h), None
    out = self.mlp.route(h)
    return x + out.y, (out.probs, out.experts)

  def _attention(self, x, positions, docs: Documents | None):
    q, k, v = self.self_attn.qkv(self.input_layernorm(x), positions)
    if docs is None:  # every row is one document from column 0: already aligned
      attn = self.self_attn.attend(q, k, v)
    else:
      attn = docs.scatter(self.self_attn.attend(docs.gather(q), docs.gather(k), docs.gather(v),
                                                docs=docs))
    return attn, k, v

  def __call__(self, x, positions, docs: Documents | None):
    """Full-sequence forward; returns the new ``x`` and this layer's ``k, v``."""
    attn, k, v = self._attention(x, positions, docs)
    return self._rest(x, attn), k, v

  def routed(self, x, positions, docs: Documents | None):
    """:meth:`__call__`'s ``x`` (the same bits) and this layer's routing: ``(probs [T, E],
    experts [T, k])`` of a MoE layer (``T = B * S``, every position), None for a dense
    one."""
    attn, _, _ = self._attention(x, positions, docs)
    return self._rest_routed(x, attn)

  def extend(self, x, positions, cache_k, cache_v, start: int):
    """A chunk of every row's prompt ``x [B, C, H]`` at ``positions`` ``start ..
    start + C - 1``: writes its ``k, v`` into the cache there and attends to slots ``0 ..``
    each query's position. Returns ``(x, cache_k, cache_v)``."""
    q, k, v = self.self_attn.qkv(self.input_layernorm(x), positions)
    cache_k = lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, start, 0, 0))
    cache_v = lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, start, 0, 0))
    seen = jnp.full((x.shape[0],), start + x.shape[1], jnp.int32)
    attn = self.self_attn.attend(q, cache_k, cache_v, q_positions=positions, kv_lengths=seen)
    return self._rest(x, attn), cache_k, cache_v

  def decode_weights(self) -> tuple[ChunkedWeight | None, ChunkedWeight | None]:
    """``o_proj`` and ``down_proj`` kernels in their chunk layout, for :meth:`decode` (a MoE
    layer has no ``down_proj``: None)."""
    down = None if self.moe else self.mlp.down_proj.chunked_kernel()
    return self.self_attn.o_proj.chunked_kernel(), down

  def decode(self, x, cache_k, cache_v, lengths, pending=None, weights=None):
    """One token per row ``x [B, 1, H]`` at position ``lengths[b]``: writes its ``k, v``
    into the cache and attends to slots ``0..lengths[b]``.

    The residual adds of ``o_proj`` and ``down_proj`` are finished by the RMSNorm that
    follows them (``RMSNorm.add``: one pass, the same bits as add then norm). ``pending``:
    the previous layer's ``down_proj`` partials (``RowParallelLinear.partials``) not yet
    added to ``x``, or None. Returns ``(x, pending, cache_k, cache_v)``: this layer's
    ``down_proj`` partials are left pending for the next norm (None when the layer cannot
    give partials, and for a MoE layer, whose output is added here as in :meth:`__call__`:
    then ``x`` is complete). ``weights``: :meth:`decode_weights`, made once before a decode
    loop (the same bits)."""
    o_w, down_w = (None, None) if weights is None else weights
    if pending is None:
      h = self.input_layernorm(x)
    else:
      x, h = self.input_layernorm.add(x, *pending)
    q, k, v = self.self_attn.qkv(h, lengths[:, None])
    rows = jnp.arange(x.shape[0])
    cache_k = cache_k.at[rows, lengths].set(k[:, 0].astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[rows, lengths].set(v[:, 0].astype(cache_v.dtype), mode="drop")
    attn = self.self_attn.attend(q, cache_k, cache_v, q_positions=lengths[:, None],
                                 kv_lengths=lengths + 1)
    b, t = attn.shape[:2]
    attn = attn.reshape(b, t, -1)
    parts = self.self_attn.o_proj.partials(attn, o_w)
    if parts is None:
      x = x + self.self_attn.o_proj(attn)
      h = self.post_attention_layernorm(x)
    else:
      x, h = self.post_attention_layernorm.add(x, *parts)
    if self.moe:
      return x + self.mlp(h), None, cache_k, cache_v
    act = self.mlp.hidden(h)
    parts = self.mlp.down_proj.partials(act, down_w)
    if parts is None:
      return x + self.mlp.down_proj(act), None, cache_k, cache_v
    return x, parts, cache_k, cache_v


_ROW_LAYERS = (("q_dim (num_attention_heads * head_dim) of o_proj", "q_dim"),
               ("intermediate_size of down_proj", "intermediate_size"))


def _check_row_chunks(cfg: DecoderConfig, row_chunks) -> None:
  if (not isinstance(row_chunks, int | np.integer) or isinstance(row_chunks, bool)
      or row_chunks < 1 or row_chunks & (row_chunks - 1)):
    raise ValueError(f"DecoderLM: row_chunks must be None or a power of two >= 1, got "
                     f"{row_chunks!r}")
  for name, field in _ROW_LAYERS:
    k = getattr(cfg, field)
    if k % row_chunks:
      raise ValueError(f"DecoderLM: row_chunks={row_chunks} must divide the {name}, which is "
                       f"{k}; pass a smaller power of two")


def canonical_row_chunks(cfg: DecoderConfig) -> tuple[int, int]:
  """The K chunks of ``(o_proj, down_proj)`` that ``DecoderLM(row_chunks=None)`` runs.

  Per layer (``K`` its input width): the most chunks, at most
  ``contract.ROW_PARALLEL_CHUNKS``, that are whole K tiles (``K / C`` a multiple of
  ``contract.GEMM_TILE_K``), and never fewer than ``t = gcd(ROW_PARALLEL_CHUNKS,
  num_key_value_heads)``, the largest TP degree :func:`~jaxrl_kernels.models.shard` takes
  for the model (it keeps GQA groups whole): every TP degree the model shards to divides
  both counts, so each runs the same canonical order. Where no count in ``[t,
  ROW_PARALLEL_CHUNKS]`` gives whole tiles, the most that divide ``K`` (their chunks
  zero-padded to whole tiles on Hopper, the same bits). Qwen2.5-0.5B: ``(2, 4)`` (chunks
  of 448 and 1216 columns, against 112 and 608 with 8: no padded or partial K tiles);
  Llama-3.2-1B: ``(8, 8)``.
  """
  most = contract.ROW_PARALLEL_CHUNKS
  least = math.gcd(most, cfg.num_key_value_heads)
  out = []
  for name, field in _ROW_LAYERS:
    k = getattr(cfg, field)
    counts = [c for c in (most >> i for i in range(most.bit_length()))
              if c >= least and k % c == 0]
    if not counts:
      raise ValueError(f"DecoderLM: the {name} ({k}) is not a multiple of {least} (the "
                       f"model's largest TP degree); pass row_chunks explicitly")
    tiled = [c for c in counts if (k // c) % contract.GEMM_TILE_K == 0]
    out.append((tiled or counts)[0])
  return out[0], out[1]


def layout(tokens, positions, segment_ids, max_docs, *, op: str = "DecoderLM"
           ) -> tuple[jax.Array, jax.Array, Documents | None]:
  """Checks a full-sequence layout and returns ``(tokens, positions [B, T], docs)``:
  ``docs`` is None for rows that are one document each from column 0 (no
  ``positions``/``segment_ids``), else the :class:`Documents` the attention uses."""
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"{op}: tokens must be [B, T], got shape {tokens.shape}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f"{op}: tokens must be integers, got {tokens.dtype}")
  b, t = tokens.shape
  arange = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  if positions is None and segment_ids is None:
    return tokens, arange, None
  positions = arange if positions is None else jnp.asarray(positions)
  segment_ids = (jnp.zeros((b, t), jnp.int32) if segment_ids is None
                 else jnp.asarray(segment_ids))
  for name, x in (("positions", positions), ("segment_ids", segment_ids)):
    if x.shape != (b, t):
      raise ValueError(f"{op}: {name} must have shape {(b, t)}, got {x.shape}")
  max_docs = b if max_docs is None else max_docs
  if not isinstance(max_docs, int) or isinstance(max_docs, bool) or max_docs < 1:
    raise ValueError(f"{op}: max_docs must be a static int >= 1, got {max_docs!r}")
  return tokens, positions, documents(positions, segment_ids, max_docs, op=op)


def _layer_forward(layer, x, positions, docs):
  return layer(x, positions, docs)[0]


def _layer_routed(layer, x, positions, docs):
  return layer.routed(x, positions, docs)


class DecoderLM(nnx.Module):
  """A Llama / Qwen2 / Qwen3 causal LM whose per-token log-probs are batch-invariant.

  Build one with :func:`jaxrl_kernels.models.from_pretrained` (a Hugging Face
  folder), :func:`jaxrl_kernels.models.preset` (random weights at a public
  shape), or directly from a :class:`DecoderConfig`.

  The methods follow :class:`~jaxrl_kernels.nn.TinyCausalLM`'s protocol (the one
  ``nn.sample`` / ``nn.score`` use): ``model(tokens, positions=, segment_ids=)``
  -> final-norm hidden states, :meth:`logp` through the fused head (no
  ``[T, V]`` logits), :meth:`init_cache` / :meth:`prefill` / :meth:`decode_step`
  on an explicit :class:`~jaxrl_kernels.nn.KVCache`, and ``head``
  (:class:`~jaxrl_kernels.nn.LMHead`, tied to ``embed_tokens`` when the config
  says so). A token's bits depend only on its document's tokens up to it.

  Args:
    config: the architecture.
    dtype: activation, compute and KV-cache dtype (``"float32"``, ``"bfloat16"`` or
      ``"float16"``).
    param_dtype: parameter storage dtype (default ``dtype``).
    implementation: passed to every op (None: the batch-invariant kernels for the
      device; ``"xla"``: the stock path, see the module docstring).
    remat: recompute each layer's activations in the backward pass (``nnx.remat``)
      instead of storing them: less memory for training, the same bits.
    row_chunks: the K chunks of ``o_proj`` and ``down_proj``'s canonical
      row-parallel order. None: per layer, :func:`canonical_row_chunks` (whole K tiles
      where the model's TP degrees allow). An int: both layers, a power of two dividing
      ``q_dim`` and ``intermediate_size``; ``1``: plain ``det_matmul`` (the same
      parameters; then only TP = 1). Part of the numerical contract (other chunks, other
      bits); a model sharded over TP = p needs ``p`` to divide each layer's chunks
      (``row_parallel_chunks``).
    rngs: initialises the weights (normal, std 0.02; norms at 1).
  """

  def __init__(self, config: DecoderConfig, *, dtype="float32", param_dtype=None,
               implementation: str | None = None, remat: bool = False,
               row_chunks: int | None = None, rngs: nnx.Rngs):
    if not isinstance(config, DecoderConfig):
      raise TypeError(f"DecoderLM: config must be a DecoderConfig, got {type(config).__name__}")
    dt = jnp.dtype(parse_dtype("DecoderLM: dtype", dtype))
    pdt = dt if param_dtype is None else jnp.dtype(parse_dtype("DecoderLM: param_dtype",
                                                              param_dtype))
    if implementation is not None and implementation not in _backend.IMPLEMENTATIONS:
      raise ValueError(f"DecoderLM: implementation must be None or one of "
                       f"{_backend.IMPLEMENTATIONS}, got {implementation!r}")
    if not isinstance(remat, bool):
      raise TypeError(f"DecoderLM: remat must be a bool, got {remat!r}")
    if row_chunks is None:
      chunks = canonical_row_chunks(config)
    else:
      _check_row_chunks(config, row_chunks)
      chunks = (int(row_chunks), int(row_chunks))
    cfg = config
    self.config = cfg
    self.dtype = dt
    self.implementation = implementation
    self.remat = remat
    self.row_chunks = None if row_chunks is None else int(row_chunks)
    # (o_proj's, down_proj's) K chunks.
    self.row_parallel_chunks = chunks
    kw = dict(dtype=dt, param_dtype=pdt, implementation=implementation, row_chunks=chunks,
              rngs=rngs)
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dt, param_dtype=pdt,
                                  embedding_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)
    self.embed_tokens.embedding.set_metadata(logical_axes=("vocab", "embed"))
    self.layers = nnx.List([DecoderLayer(cfg, index=i, **kw)
                            for i in range(cfg.num_hidden_layers)])
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pdt,
                        implementation=implementation)
    tied = self.embed_tokens.embedding if cfg.tie_word_embeddings else None
    self.head = LMHead(cfg.hidden_size, cfg.vocab_size, tied_embedding=tied, param_dtype=pdt,
                       kernel_init=nnx.initializers.normal(_INIT_STD),
                       implementation=implementation, rngs=rngs)
    if tied is None:
      self.head.kernel.set_metadata(logical_axes=("embed", "vocab"))

  # ------------------------------------------------------------------------- full sequence

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, *, max_docs: int | None = None
               ) -> jax.Array:
    """Final-norm hidden states ``[B, T, H]`` in ``dtype``.

    Layouts as :meth:`TinyCausalLM.__call__ <jaxrl_kernels.nn.TinyCausalLM.__call__>`:
    right padding (no arguments), left padding (``positions = arange(T) - pad``;
    negative positions are padding), packing (``segment_ids``, positions
    restarting at 0 per document), any mix; ``max_docs`` (static, default
    ``B``) bounds the number of documents in the batch.

    Args:
      tokens: ``[B, T]`` int ids in ``[0, V)``.
      positions: ``[B, T]`` int, default ``arange(T)``.
      segment_ids: ``[B, T]`` int, default all 0.
      max_docs: static int >= 1 (only with ``positions`` or ``segment_ids``).
    """
    tokens = check_token_ids("DecoderLM", "tokens", tokens, self.config.vocab_size)
    if not self._traced(tokens, positions, segment_ids):
      # Eager calls run under one jit: the bits of the jitted (sampler's) program.
      return _jit_call(self, tokens, positions, segment_ids, max_docs=max_docs)
    tokens, positions, docs = layout(tokens, positions, segment_ids, max_docs)
    x = embed_ids(self.embed_tokens, tokens, self.config.vocab_size)
    forward = nnx.remat(_layer_forward) if self.remat else _layer_forward
    for layer in self.layers:
      x = forward(layer, x, positions, docs)
    return self.norm(x)

  def route(self, tokens: jax.Array, positions: jax.Array | None = None,
            segment_ids: jax.Array | None = None, *, max_docs: int | None = None
            ) -> tuple[jax.Array, tuple[tuple[jax.Array, jax.Array], ...]]:
    """``(hidden, routing)``: :meth:`__call__`'s final-norm hidden states ``[B, T, H]``
    and, per MoE layer in order, its router's ``(probs [B*T, E] float32, experts [B*T, k]
    int32)`` over every position (padding included: mask it in :meth:`router_aux_loss`).
    One forward for a training step that adds the router loss to the head's
    (``self.head.policy_loss(hidden, ...)``). Arguments as :meth:`__call__`."""
    tokens = check_token_ids("DecoderLM.route", "tokens", tokens, self.config.vocab_size)
    if not self._traced(tokens, positions, segment_ids):
      return _jit_route(self, tokens, positions, segment_ids, max_docs=max_docs)
    tokens, positions, docs = layout(tokens, positions, segment_ids, max_docs,
                                     op="DecoderLM.route")
    x = embed_ids(self.embed_tokens, tokens, self.config.vocab_size)
    forward = nnx.remat(_layer_routed) if self.remat else _layer_routed
    routing = []
    for layer in self.layers:
      x, r = forward(layer, x, positions, docs)
      if r is not None:
        routing.append(r)
    return self.norm(x), tuple(routing)

  def router_aux_loss(self, routing: tuple, mask: jax.Array | None = None) -> jax.Array:
    """``transformers``' load-balancing loss (``load_balancing_loss_func``) of
    :meth:`route`'s ``routing``: the MoE layers' tokens concatenated, ``E * sum_{j,e}
    f[j, e] P[e]`` (:func:`jaxrl_kernels.moe.load_balancing_loss`), over the positions
    where ``mask [B, T]`` is True (None: all). Unweighted: ``transformers`` adds
    ``config.router_aux_loss_coef`` times it to the LM loss. float32 scalar."""
    if not routing:
      raise ValueError(f"DecoderLM.router_aux_loss: routing is empty (this "
                       f"{self.config.model_type!r} model has no MoE layer)")
    probs = jnp.concatenate([p for p, _ in routing], axis=0)
    experts = jnp.concatenate([e for _, e in routing], axis=0)
    if mask is not None:
      mask = jnp.asarray(mask)
      if mask.size * len(routing) != probs.shape[0]:
        raise ValueError(f"DecoderLM.router_aux_loss: mask must have one entry per token "
                         f"({probs.shape[0] // len(routing)}), got shape {mask.shape}")
      mask = jnp.tile(mask.reshape(-1), len(routing))
    return load_balancing_loss(probs, experts, mask, implementation=self.implementation)

  def logp(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None, *,
           positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
           max_docs: int | None = None, temperature: float = 1.0,
           return_entropy: bool = False):
    """float32 ``log softmax(z / temperature)[targets]`` ``[B, T]`` (and the entropy)
    through the fused head: the ``[B, T, V]`` logits never exist. ``mask`` False
    positions give 0 (and zero gradient). Called outside a trace, runs under one jit (the
    bits of the jitted program)."""
    temperature = as_temperature("DecoderLM.logp", temperature)
    tokens = check_token_ids("DecoderLM.logp", "tokens", tokens, self.config.vocab_size)
    if not self._traced(tokens, targets, mask, positions, segment_ids, temperature):
      return _jit_logp(self, tokens, targets, mask, positions=positions,
                       segment_ids=segment_ids, max_docs=max_docs, temperature=temperature,
                       return_entropy=return_entropy)
    h = self(tokens, positions, segment_ids, max_docs=max_docs)
    return self.head(h, targets, mask, temperature=temperature, return_entropy=return_entropy)

  def policy_loss(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
                  *, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                  max_docs: int | None = None, temperature: float = 1.0, **objective):
    """``(loss, metrics)`` of :func:`jaxrl_kernels.rl.linear_policy_loss`: the policy loss
    fused into the head (its gradient formed in the forward pass); ``objective`` holds its
    keyword arguments (``old_logp``, ``advantages``, ``ref_logp``, ``beta``,
    ``entropy_coef``, ``clip_low``, ...). ``metrics["logp"]`` is bitwise :meth:`logp`'s (the
    sampler's). For a training step: call it under ``jax.jit`` / ``jax.grad``."""
    temperature = as_temperature("DecoderLM.policy_loss", temperature)
    tokens = check_token_ids("DecoderLM.policy_loss", "tokens", tokens, self.config.vocab_size)
    h = self(tokens, positions, segment_ids, max_docs=max_docs)
    return self.head.policy_loss(h, targets, mask, temperature=temperature, **objective)

  def logits(self, tokens: jax.Array, *, positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None, max_docs: int | None = None,
             temperature: float = 1.0) -> jax.Array:
    """float32 logits ``[B, T, V]`` (for checks against references; training uses
    :meth:`logp`)."""
    temperature = as_temperature("DecoderLM.logits", temperature)
    tokens = check_token_ids("DecoderLM.logits", "tokens", tokens, self.config.vocab_size)
    if not self._traced(tokens, positions, segment_ids, temperature):
      return _jit_logits(self, tokens, positions=positions, segment_ids=segment_ids,
                         max_docs=max_docs, temperature=temperature)
    h = self(tokens, positions, segment_ids, max_docs=max_docs)
    return self.head.logits(h, temperature=temperature)

  def _traced(self, *xs) -> bool:
    """True inside a trace: an argument or a parameter is a tracer."""
    if is_traced(*xs):
      return True
    # A parameter: tracers under nnx.jit / grad of the model (the arguments may be constants).
    return is_traced(self.norm.weight.get_value())

  # ---------------------------------------------------------------------------- KV cache

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    """An empty cache of ``batch`` rows of up to ``max_len`` tokens (prompt + completion):
    per layer ``[batch, max_len, Hkv, head_dim]`` keys and values in ``dtype``."""
    cfg = self.config
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, self.dtype) for _ in range(cfg.num_hidden_layers))
    return KVCache(zeros, zeros, jnp.zeros((batch,), jnp.int32))

  def prefill(self, tokens: jax.Array, lengths: jax.Array, cache: KVCache, *,
              chunk: int | None = None) -> tuple[jax.Array, KVCache]:
    """Right-padded prompts ``tokens [B, P]`` of ``lengths [B]`` (``1 <= lengths <= P``).

    Writes the cache from position 0 (slots at or past ``lengths[b]`` hold the
    pads' keys, never read: decode overwrites them and masks past ``lengths``).

    ``chunk``: a static int ``C >= 1``: the prompts in chunks of ``C`` positions, each
    attending to the cache written by the chunks before it (a long prompt never needs one
    ``[B, P]`` pass). Every row computation is the one-pass prefill's (the attention of a
    query walks its keys from position 0 in the same tiles, whatever the number of queries
    or the cache length; every other op is row-local), so the cache at positions below
    ``lengths`` and the returned hidden states are bitwise those of ``chunk=None``.

    Returns:
      ``(hidden [B, H], cache)``: the final-norm hidden state of each row's last
      prompt token and the cache with ``lengths``.
    """
    v = self.config.vocab_size
    tokens, lengths = check_prefill("DecoderLM.prefill", tokens, lengths, cache, v)
    b, p = tokens.shape
    if chunk is not None:
      if isinstance(chunk, bool) or not isinstance(chunk, int | np.integer) or chunk < 1:
        raise ValueError(f"DecoderLM.prefill: chunk must be None or a static int >= 1, got "
                         f"{chunk!r}")
      if self.implementation == "xla":
        raise ValueError("DecoderLM.prefill: chunk needs the invariant kernels; "
                         "implementation='xla' (the stock baseline) prefills in one pass")
      return self._prefill_chunks(tokens, lengths, cache, int(chunk))
    x = embed_ids(self.embed_tokens, tokens, v)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    keys, values = [], []
    for layer, ck, cv in zip(self.layers, cache.keys, cache.values, strict=True):
      x, k, v = layer(x, positions, None)
      keys.append(lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, 0, 0, 0)))
      values.append(lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, 0, 0, 0)))
    h = self.norm(x)[jnp.arange(b), lengths - 1]
    return h, KVCache(tuple(keys), tuple(values), lengths)

  def _prefill_chunks(self, tokens, lengths, cache: KVCache, chunk: int):
    """:meth:`prefill` in chunks of ``chunk`` positions (static loop over the chunks)."""
    b, p = tokens.shape
    keys, values = list(cache.keys), list(cache.values)
    h_last = None
    rows = jnp.arange(b)
    for s in range(0, p, chunk):
      c = min(chunk, p - s)
      positions = jnp.broadcast_to(jnp.arange(s, s + c, dtype=jnp.int32), (b, c))
      x = embed_ids(self.embed_tokens, tokens[:, s:s + c], self.config.vocab_size)
      for i, layer in enumerate(self.layers):
        x, keys[i], values[i] = layer.extend(x, positions, keys[i], values[i], s)
      y = self.norm(x)
      # The row's last prompt token, if it lies in this chunk.
      at = jnp.clip(lengths - 1 - s, 0, c - 1)
      here = (lengths - 1 >= s) & (lengths - 1 < s + c)
      pick = y[rows, at]
      h_last = pick if h_last is None else jnp.where(here[:, None], pick, h_last)
    return h_last, KVCache(tuple(keys), tuple(values), lengths)

  def decode_weights(self) -> tuple | None:
    """Each layer's ``o_proj`` / ``down_proj`` kernels in their chunk layout, for
    ``decode_step(..., weights=)``: made once before a decode loop, they keep a chunk
    layout's copy (a padded chunk, ``gemm.chunk_weight``) out of every step. None where no
    layer has such kernels."""
    weights = tuple(layer.decode_weights() if isinstance(layer, DecoderLayer) else None
                    for layer in self.layers)
    return weights if any(w is not None and any(x is not None for x in w)
                          for w in weights) else None

  def decode_step(self, token: jax.Array, cache: KVCache, weights: tuple | None = None
                  ) -> tuple[jax.Array, KVCache]:
    """Appends ``token [B]`` at position ``cache.lengths[b]`` of each row.

    Returns ``(hidden [B, H], cache)`` with ``lengths + 1``; a row whose cache is
    full writes nothing, keeps its length and gets a NaN hidden state. ``weights``:
    :meth:`decode_weights` of this model (the same bits, forward only).
    """
    v = self.config.vocab_size
    token = check_decode_token("DecoderLM.decode_step", token, cache, v)
    lengths = cache.lengths
    x = embed_ids(self.embed_tokens, token[:, None], v)
    keys, values = [], []
    pending = None  # a layer's down_proj partials, added by the next norm
    if weights is None:
      weights = (None,) * len(self.layers)
    elif len(weights) != len(self.layers):
      raise ValueError(f"DecoderLM.decode_step: weights must be this model's decode_weights() "
                       f"({len(self.layers)} layers), got {len(weights)} entries")
    for layer, ck, cv, w in zip(self.layers, cache.keys, cache.values, weights, strict=True):
      x, pending, ck, cv = layer.decode(x, ck, cv, lengths, pending, w)
      keys.append(ck)
      values.append(cv)
    h = (self.norm(x) if pending is None else self.norm.add(x, *pending)[1])[:, 0]
    return finish_decode(h, cache, keys, values)


_jit_call = nnx.jit(DecoderLM.__call__, static_argnames=("max_docs",))
_jit_route = nnx.jit(DecoderLM.route, static_argnames=("max_docs",))
_jit_logp = nnx.jit(DecoderLM.logp, static_argnames=("max_docs", "temperature",
                                                     "return_entropy"))
_jit_logits = nnx.jit(DecoderLM.logits, static_argnames=("max_docs", "temperature"))


def num_params(model: DecoderLM) -> int:
  """The number of parameters (a tied embedding counted once)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
