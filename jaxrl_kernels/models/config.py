"""``DecoderConfig``: the architecture of a Llama / Qwen2 / Qwen3 decoder, or of a
Qwen3-MoE / Mixtral mixture-of-experts decoder, read from and written to a Hugging Face
``config.json``, and the presets at the true public shapes.

Only what changes the forward is kept; every other key of ``config.json`` is
carried through unchanged in ``extra`` so that :func:`save_pretrained` writes it
back. Options this package does not implement are refused with a ``ValueError``
naming the key (never silently ignored): see :func:`from_hf_dict`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

from jaxrl_kernels.nn.rotary import rope_frequencies

MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
#: The mixture-of-experts model types (their MLPs are ``moe.moe_mlp`` layers).
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
ROPE_TYPES = ("default", "llama3")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM"}


#: The dtype strings :func:`parse_dtype` accepts, and the dtype each one means.
DTYPE_NAMES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32), "fp32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16), "bf16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16), "fp16": np.dtype(np.float16),
}
AUTO = "auto"


def parse_dtype(name: str, value, *, allow_auto: bool = False) -> np.dtype | str:
  """The model dtype ``value`` means: ``"float32"``/``"fp32"``, ``"bfloat16"``/``"bf16"``,
  ``"float16"``/``"fp16"``, or a numpy / ``jax.numpy`` dtype (or scalar type) of one of
  those three; with ``allow_auto``, also ``"auto"``, returned as the string ``"auto"`` (the
  caller resolves it, e.g. to a checkpoint's ``torch_dtype``).

  Args:
    name: the argument's name, used in the error (``"from_pretrained: dtype"``,
      ``"--model-dtype"``).
    value: the string or dtype to parse.
    allow_auto: accept ``"auto"``.

  Returns:
    A ``numpy.dtype`` (``float32``, ``bfloat16`` or ``float16``), or ``"auto"``.

  Raises:
    ValueError: naming ``name``, the accepted values and ``value``.
  """
  accepted = (*DTYPE_NAMES, *((AUTO,) if allow_auto else ()))
  if isinstance(value, str):
    if allow_auto and value == AUTO:
      return AUTO
    if value in DTYPE_NAMES:
      return DTYPE_NAMES[value]
    raise ValueError(f"{name} must be one of {accepted} (or a numpy/jax.numpy dtype of one "
                     f"of them), got {value!r}")
  try:
    dt = np.dtype(value) if value is not None and not isinstance(value, bool) else None
  except TypeError:
    dt = None
  if dt is None or dt not in DTYPE_NAMES.values():
    got = value if dt is None else dt.name
    raise ValueError(f"{name} must be one of {accepted} (or a numpy/jax.numpy dtype of one "
                     f"of them), got {got!r}")
  return dt


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Shapes and numerics of a pre-norm GQA decoder with SwiGLU MLP and rotary positions.

  Attributes:
    model_type: ``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"qwen3_moe"`` or ``"mixtral"``.
    vocab_size, hidden_size, intermediate_size, num_hidden_layers: sizes
      (``intermediate_size``: the dense MLPs'; Mixtral's experts').
    num_attention_heads, num_key_value_heads, head_dim: GQA heads (``head_dim`` may
      differ from ``hidden_size / num_attention_heads``, as in Qwen3).
    rms_norm_eps: RMSNorm epsilon.
    rope_theta: rotary base.
    rope_scaling: None, or ``("llama3", factor, low_freq_factor, high_freq_factor,
      original_max_position_embeddings)``.
    attention_bias: biases on q, k, v (Qwen2: always; Llama: also on o).
    mlp_bias: biases on gate, up, down (Llama only).
    qk_norm: RMSNorm over ``head_dim`` of q and k before rotary (Qwen3).
    tie_word_embeddings: the LM head reads the ``[V, H]`` embedding.
    max_position_embeddings: carried for ``config.json`` (no effect on the forward).
    extra: the other keys of ``config.json`` (token ids, dtype, ...), as sorted pairs.
    num_experts: experts per MoE layer (0: a dense model; ``qwen3_moe`` / ``mixtral``
      need >= 1).
    num_experts_per_tok: the top-k experts each token is routed to (``1 <= k <=
      num_experts``).
    moe_intermediate_size: an expert's FFN width (Mixtral: ``intermediate_size``).
    norm_topk_prob: renormalize the top-k router probabilities (Mixtral: always).
    decoder_sparse_step, mlp_only_layers: which layers are MoE (:meth:`is_moe_layer`).
    router_aux_loss_coef: the load-balancing loss weight ``transformers`` adds to its
      loss (carried; ``DecoderLM.router_aux_loss`` returns the unweighted loss).
  """

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: tuple | None = None
  attention_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  extra: tuple = ()
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple = ()
  router_aux_loss_coef: float = 0.0

  def __post_init__(self):
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f"DecoderConfig: model_type must be one of {MODEL_TYPES}, got "
                       f"{self.model_type!r}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim"):
      value = getattr(self, name)
      if (not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1
          or value >= 2**31):
        raise ValueError(f"DecoderConfig: {name} must be an int in [1, 2**31), got {value!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"DecoderConfig: num_attention_heads={self.num_attention_heads} must be "
                       f"a multiple of num_key_value_heads={self.num_key_value_heads}")
    if self.head_dim % 2:
      raise ValueError(f"DecoderConfig: head_dim must be even for rotary, got {self.head_dim}")
    if not _positive_float32(self.rope_theta):
      raise ValueError(f"DecoderConfig: rope_theta must be a finite number > 0 (in float32), "
                       f"got {self.rope_theta!r}")
    eps = self.rms_norm_eps
    if not _is_real(eps) or not math.isfinite(eps) or eps < 0:
      raise ValueError(f"DecoderConfig: rms_norm_eps must be a finite number >= 0, got {eps!r}")
    if self.rope_scaling is not None:
      rs = self.rope_scaling
      if not isinstance(rs, tuple) or len(rs) != 5 or rs[0] != "llama3":
        raise ValueError(f"DecoderConfig: rope_scaling must be None or ('llama3', factor, "
                         f"low_freq_factor, high_freq_factor, "
                         f"original_max_position_embeddings), got {rs!r}")
      _, factor, low, high, old_len = rs
      if not (_positive_float32(factor) and _positive_float32(low) and _positive_float32(high)
              and high > low and isinstance(old_len, int | np.integer) and old_len >= 1):
        raise ValueError(f"DecoderConfig: rope_scaling ('llama3') needs factor, "
                         f"low_freq_factor, high_freq_factor finite > 0 with high_freq_factor > "
                         f"low_freq_factor, and original_max_position_embeddings an int >= 1; "
                         f"got {rs!r}")
    self._check_moe()

  def _check_moe(self):
    """The mixture-of-experts fields (errors name the field)."""
    moe = self.model_type in MOE_MODEL_TYPES
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
      value = getattr(self, name)
      low = 1 if moe else 0
      if (not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low
          or value >= 2**31):
        raise ValueError(f"DecoderConfig: {name} must be an int in [{low}, 2**31) for "
                         f"model_type {self.model_type!r}, got {value!r}")
    if not moe:
      if self.num_experts or self.num_experts_per_tok or self.moe_intermediate_size:
        raise ValueError(f"DecoderConfig: num_experts, num_experts_per_tok and "
                         f"moe_intermediate_size must be 0 for the dense model_type "
                         f"{self.model_type!r}, got {self.num_experts}, "
                         f"{self.num_experts_per_tok}, {self.moe_intermediate_size}")
    elif self.num_experts_per_tok > self.num_experts:
      raise ValueError(f"DecoderConfig: num_experts_per_tok must be in [1, num_experts="
                       f"{self.num_experts}], got {self.num_experts_per_tok}")
    if not isinstance(self.norm_topk_prob, bool | np.bool_):
      raise ValueError(f"DecoderConfig: norm_topk_prob must be a bool, got "
                       f"{self.norm_topk_prob!r}")
    step = self.decoder_sparse_step
    if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 1:
      raise ValueError(f"DecoderConfig: decoder_sparse_step must be an int >= 1, got {step!r}")
    layers = self.mlp_only_layers
    if not isinstance(layers, tuple) or any(
        not isinstance(i, int | np.integer) or isinstance(i, bool)
        or not 0 <= i < self.num_hidden_layers for i in layers):
      raise ValueError(f"DecoderConfig: mlp_only_layers must be a tuple of layer indices in "
                       f"[0, num_hidden_layers={self.num_hidden_layers}), got {layers!r}")
    coef = self.router_aux_loss_coef
    if not _is_real(coef) or not math.isfinite(coef) or coef < 0:
      raise ValueError(f"DecoderConfig: router_aux_loss_coef must be a finite number >= 0, got "
                       f"{coef!r}")
    if self.model_type == "mixtral":
      if not self.norm_topk_prob or step != 1 or layers:
        raise ValueError(f"DecoderConfig: mixtral routes every layer with normalized top-k "
                         f"weights: norm_topk_prob must be True, decoder_sparse_step 1 and "
                         f"mlp_only_layers (), got {self.norm_topk_prob}, {step}, {layers}")
      if self.moe_intermediate_size != self.intermediate_size:
        raise ValueError(f"DecoderConfig: mixtral's experts are intermediate_size wide: "
                         f"moe_intermediate_size must equal intermediate_size="
                         f"{self.intermediate_size}, got {self.moe_intermediate_size}")
    if moe and (self.attention_bias or self.mlp_bias):
      raise ValueError(f"DecoderConfig: {self.model_type} has no attention_bias or mlp_bias, "
                       f"got {self.attention_bias}, {self.mlp_bias}")

  def is_moe_layer(self, i: int) -> bool:
    """Whether layer ``i`` is a mixture-of-experts layer (``transformers``' Qwen3-MoE
    rule: not in ``mlp_only_layers``, ``num_experts > 0`` and ``(i + 1) %
    decoder_sparse_step == 0``; every layer of Mixtral)."""
    return (i not in self.mlp_only_layers and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0)

  @property
  def q_dim(self) -> int:
    return self.num_attention_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.num_key_value_heads * self.head_dim

  def inv_freq(self) -> np.ndarray:
    """float32 ``[head_dim / 2]`` rotary frequencies, computed as ``transformers`` does:
    ``1 / theta ** (arange(0, d, 2) / d)`` in float32, then the ``llama3`` rescaling."""
    inv = rope_frequencies(self.rope_theta, self.head_dim)
    if self.rope_scaling is None:
      return inv.astype(np.float32)
    _, factor, low, high, old_len = self.rope_scaling
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((np.float32(old_len) / wavelen - np.float32(low))
              / np.float32(high - low)).astype(np.float32)
    smoothed = ((np.float32(1) - smooth) * scaled / np.float32(factor)
                + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)

  def num_params(self) -> int:
    h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
    attn = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
    per_layer = attn + 3 * h * i + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
    if self.attention_bias:
      per_layer += self.q_dim + 2 * self.kv_dim + (h if self.model_type == "llama" else 0)
    if self.mlp_bias:
      per_layer += 2 * i + h
    total = v * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + h
    # A MoE layer holds a router [H, E] and E experts of width moe_intermediate_size instead
    # of the dense MLP.
    moe_mlp = h * self.num_experts + self.num_experts * 3 * h * self.moe_intermediate_size
    moe_layers = sum(self.is_moe_layer(j) for j in range(self.num_hidden_layers))
    return total + moe_layers * (moe_mlp - 3 * h * i)

  def to_hf_dict(self) -> dict[str, Any]:
    """The ``config.json`` dictionary (``transformers`` reads it back to the same model)."""
    out: dict[str, Any] = _thaw_extra(self.extra)
    out.update(
        architectures=[_ARCHITECTURES[self.model_type]], model_type=self.model_type,
        vocab_size=int(self.vocab_size), hidden_size=int(self.hidden_size),
        intermediate_size=int(self.intermediate_size),
        num_hidden_layers=int(self.num_hidden_layers),
        num_attention_heads=int(self.num_attention_heads),
        num_key_value_heads=int(self.num_key_value_heads), head_dim=int(self.head_dim),
        hidden_act="silu", rms_norm_eps=float(self.rms_norm_eps),
        rope_theta=float(self.rope_theta),
        tie_word_embeddings=bool(self.tie_word_embeddings),
        max_position_embeddings=int(self.max_position_embeddings), attention_dropout=0.0)
    out.pop("rope_parameters", None)
    if self.rope_scaling is None:
      out["rope_scaling"] = None
    else:
      _, factor, low, high, old_len = self.rope_scaling
      out["rope_scaling"] = dict(rope_type="llama3", factor=factor, low_freq_factor=low,
                                 high_freq_factor=high,
                                 original_max_position_embeddings=old_len)
    if self.model_type == "llama":
      out.update(attention_bias=bool(self.attention_bias), mlp_bias=bool(self.mlp_bias))
    elif self.model_type == "qwen2":
      out.update(use_sliding_window=False)
    elif self.model_type in ("qwen3", "qwen3_moe"):
      out.update(attention_bias=False, use_sliding_window=False)
    if self.model_type == "qwen3_moe":
      out.update(num_experts=int(self.num_experts),
                 num_experts_per_tok=int(self.num_experts_per_tok),
                 moe_intermediate_size=int(self.moe_intermediate_size),
                 norm_topk_prob=bool(self.norm_topk_prob),
                 decoder_sparse_step=int(self.decoder_sparse_step),
                 mlp_only_layers=[int(i) for i in self.mlp_only_layers],
                 router_aux_loss_coef=float(self.router_aux_loss_coef))
    elif self.model_type == "mixtral":
      out.update(num_local_experts=int(self.num_experts),
                 num_experts_per_tok=int(self.num_experts_per_tok),
                 router_aux_loss_coef=float(self.router_aux_loss_coef),
                 sliding_window=None, router_jitter_noise=0.0)
    return out


def _is_real(x) -> bool:
  return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


def _positive_float32(x) -> bool:
  """``x`` is a real number > 0 that stays finite and nonzero in float32 (the rotary tables'
  dtype)."""
  if not _is_real(x) or not math.isfinite(x) or x <= 0:
    return False
  with np.errstate(over="ignore", under="ignore"):
    x32 = np.float32(x)
  return bool(np.isfinite(x32) and x32 > 0)


#: ``transformers``' defaults for keys a ``config.json`` may leave out (LlamaConfig,
#: Qwen2Config, Qwen3Config, Qwen3MoeConfig, MixtralConfig). ``None`` for ``head_dim`` /
#: ``num_key_value_heads``: ``hidden_size // num_attention_heads`` / ``num_attention_heads``
#: (Qwen3-MoE's and Mixtral's attention read ``head_dim`` with that fallback). Qwen2/Qwen3 fill
#: ``num_key_value_heads`` from ``num_attention_heads`` only when the key is null; absent, it
#: is the class default. ``rope_theta`` / ``rms_norm_eps`` where they differ from 10000 /
#: 1e-6; the MoE keys' defaults for the MoE types.
_DEFAULTS = {
    "llama": dict(head_dim=None, num_key_value_heads=None, max_position_embeddings=2048),
    "qwen2": dict(head_dim=None, num_key_value_heads=32, max_position_embeddings=32768),
    "qwen3": dict(head_dim=128, num_key_value_heads=32, max_position_embeddings=32768),
    "qwen3_moe": dict(head_dim=None, num_key_value_heads=4, max_position_embeddings=32768,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      norm_topk_prob=False, decoder_sparse_step=1, router_aux_loss_coef=0.001),
    "mixtral": dict(head_dim=None, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    rope_theta=1e6, rms_norm_eps=1e-5, num_experts=8, num_experts_per_tok=2,
                    router_aux_loss_coef=0.001),
}


class _Reader:
  """Typed reads of a ``config.json`` dictionary; errors name the source and the key."""

  def __init__(self, d: dict, source: str):
    self.d, self.source = d, source

  def fail(self, key: str, expected: str, value) -> ValueError:
    return ValueError(f"{self.source}: {key} must be {expected}, got {value!r}")

  def int(self, key: str, default=None, *, required: bool = False, d: dict | None = None,
          null_default: bool = True):
    d = self.d if d is None else d
    if key not in d or (d[key] is None and null_default):
      if required:
        raise ValueError(f"{self.source}: the required key {key!r} is missing")
      return default
    v = d[key]
    if isinstance(v, float) and v.is_integer():
      v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
      raise self.fail(key, "an int", v)
    return v

  def float(self, key: str, default, *, d: dict | None = None, null_default: bool = True):
    d = self.d if d is None else d
    if key not in d or (d[key] is None and null_default):
      return default
    v = d[key]
    if not _is_real(v):
      raise self.fail(key, "a number", v)
    return float(v)

  def bool(self, key: str, default: bool) -> bool:
    v = self.d.get(key, default)
    if v is None:
      return default
    if not isinstance(v, bool):
      raise self.fail(key, "true or false", v)
    return v


def from_hf_dict(d: dict[str, Any], *, source: str = "config.json") -> DecoderConfig:
  """A :class:`DecoderConfig` from a ``config.json`` dictionary.

  Keys left out take ``transformers``' defaults for the model type (``head_dim``: 128 for
  Qwen3, ``hidden_size // num_attention_heads`` otherwise; ``num_key_value_heads``:
  ``num_attention_heads`` for Llama or when null, 32 for Qwen2/Qwen3 when absent;
  ``rope_theta``: 10000; ``rms_norm_eps``: 1e-6).

  Refused with a ``ValueError`` naming ``source`` and the key: a dictionary that is not a
  JSON object; a value of the wrong type (``rope_theta: null``, ``vocab_size: "7"``); an
  unknown ``model_type``; ``hidden_act`` other than ``silu``; sliding-window attention
  (``use_sliding_window`` true or a ``layer_types`` entry other than
  ``full_attention``); ``rope_scaling`` / ``rope_parameters`` of a type other
  than ``default`` or ``llama3`` (or ``llama3`` on a non-Llama model);
  ``attention_dropout`` > 0; ``mlp_bias`` on Qwen; ``attention_bias`` on Qwen3;
  partial rotary (``partial_rotary_factor`` != 1); ``attention_bias`` on Qwen3-MoE and
  Mixtral; Mixtral's ``sliding_window`` other than null and ``router_jitter_noise`` other
  than 0; and what :class:`DecoderConfig` refuses (``rope_theta <= 0`` or not finite, sizes
  < 1, ``num_experts_per_tok > num_experts``, ...).

  Mixture-of-experts keys: Qwen3-MoE ``num_experts``, ``num_experts_per_tok``,
  ``moe_intermediate_size`` (the experts; ``intermediate_size`` is the dense layers'),
  ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``,
  ``router_aux_loss_coef``; Mixtral ``num_local_experts``, ``num_experts_per_tok``,
  ``router_aux_loss_coef`` (its experts are ``intermediate_size`` wide, their top-k
  weights always renormalized). Absent, they take ``transformers``' defaults; null, they
  are refused (``transformers`` 5 refuses them and no version runs with them), except
  ``mlp_only_layers`` (null: none), ``norm_topk_prob`` (null: false, as ``transformers`` 4
  reads it) and Mixtral's ``router_jitter_noise``. Keys of other MoE architectures (e.g.
  Qwen2-MoE's ``shared_expert_intermediate_size``) are carried in ``extra`` and, like
  ``transformers``' Qwen3-MoE, ignored; tensors for them are refused by ``from_pretrained``.
  """
  if not isinstance(d, dict):
    raise ValueError(f"{source}: must hold a JSON object, got a {type(d).__name__}")
  r = _Reader(d, source)
  model_type = d.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"{source}: model_type must be one of {MODEL_TYPES}, got {model_type!r}")
  defaults = _DEFAULTS[model_type]
  act = d.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"{source}: hidden_act must be 'silu', got {act!r}")
  if r.bool("use_sliding_window", False):
    raise ValueError(f"{source}: use_sliding_window=true (sliding-window attention) is not "
                     "supported")
  layer_types = d.get("layer_types")
  if layer_types is not None and not isinstance(layer_types, list):
    raise r.fail("layer_types", "a list", layer_types)
  if layer_types and any(t != "full_attention" for t in layer_types):
    raise ValueError(f"{source}: layer_types must all be 'full_attention', got "
                     f"{sorted({str(t) for t in layer_types})}")
  if r.float("attention_dropout", 0.0) != 0.0:
    raise ValueError(f"{source}: attention_dropout must be 0, got {d['attention_dropout']}")
  if r.float("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{source}: partial_rotary_factor must be 1, got "
                     f"{d['partial_rotary_factor']}")
  # transformers 4.x writes rope_theta + rope_scaling; 5.x writes rope_parameters.
  rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
  rope = d.get(rope_key) or {}
  if not isinstance(rope, dict):
    raise r.fail(rope_key, "an object or null", rope)
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in ROPE_TYPES or (rope_type == "llama3" and model_type != "llama"):
    raise ValueError(f"{source}: rope type {rope_type!r} is not supported for "
                     f"{model_type!r} (supported: 'default', and 'llama3' for llama)")
  # A null rope_theta is refused (transformers fails on it too), never read as the default.
  if "rope_theta" in rope:
    theta = r.float("rope_theta", None, d=rope, null_default=False)
  else:
    theta = r.float("rope_theta", defaults.get("rope_theta", 10000.0), null_default=False)
  if theta is None or not _positive_float32(theta):
    raise r.fail("rope_theta", "a finite number > 0 (in float32)", theta)
  scaling = None
  if rope_type == "llama3":
    keys = ("factor", "low_freq_factor", "high_freq_factor")
    for key in (*keys, "original_max_position_embeddings"):
      if rope.get(key) is None:
        raise ValueError(f"{source}: {rope_key} of type 'llama3' needs {key!r}")
    scaling = ("llama3", *(r.float(k, None, d=rope) for k in keys),
               r.int("original_max_position_embeddings", d=rope))
  attention_bias = r.bool("attention_bias", False)
  mlp_bias = r.bool("mlp_bias", False)
  if model_type == "qwen2":
    attention_bias = True  # Qwen2 always has q/k/v biases (no config key)
  if model_type != "llama" and mlp_bias:
    raise ValueError(f"{source}: mlp_bias=true is not supported for {model_type!r}")
  if model_type in ("qwen3", *MOE_MODEL_TYPES) and attention_bias:
    raise ValueError(f"{source}: attention_bias=true is not supported for {model_type!r}")
  moe = _read_moe(r, model_type, defaults) if model_type in MOE_MODEL_TYPES else {}
  heads = r.int("num_attention_heads", required=True)
  hidden = r.int("hidden_size", required=True)
  kv_default = defaults["num_key_value_heads"]
  if "num_key_value_heads" in d and d["num_key_value_heads"] is None:
    kv_default = None
  kv_heads = r.int("num_key_value_heads", kv_default)
  head_dim = r.int("head_dim", defaults["head_dim"])
  known = {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
           "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias",
           "tie_word_embeddings", "max_position_embeddings", "hidden_act", "attention_dropout",
           "architectures", "use_sliding_window",
           # the storage dtype: save_pretrained writes the model's own
           "torch_dtype", "dtype"}
  if model_type in MOE_MODEL_TYPES:
    known |= _MOE_KEYS[model_type]
  extra = tuple(sorted((k, v) for k, v in d.items() if k not in known))
  try:
    return DecoderConfig(
        model_type=model_type,
        vocab_size=r.int("vocab_size", required=True),
        hidden_size=hidden,
        intermediate_size=r.int("intermediate_size", required=True),
        num_hidden_layers=r.int("num_hidden_layers", required=True),
        num_attention_heads=heads,
        num_key_value_heads=heads if kv_heads is None else kv_heads,
        head_dim=hidden // heads if head_dim is None and heads > 0 else head_dim or 0,
        rms_norm_eps=r.float("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, attention_bias=attention_bias,
        mlp_bias=mlp_bias, qk_norm=model_type in ("qwen3", "qwen3_moe"),
        # transformers' default for all three architectures when the key is absent.
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        max_position_embeddings=r.int("max_position_embeddings",
                                      defaults["max_position_embeddings"]),
        extra=_freeze(extra), **moe)
  except ValueError as e:
    raise ValueError(f"{source}: {e}") from None


#: The config keys each MoE type reads (the rest are carried in ``extra``;
#: ``output_router_logits`` among them).
_MOE_KEYS = {
    "qwen3_moe": {"num_experts", "num_local_experts", "num_experts_per_tok",
                  "moe_intermediate_size",
                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                  "router_aux_loss_coef"},
    "mixtral": {"num_local_experts", "num_experts", "num_experts_per_tok", "router_aux_loss_coef",
                "router_jitter_noise", "sliding_window"},
}


def _num_experts(r: _Reader, own: str, default: int) -> int:
  """The expert count under the type's own key or the other one (``num_experts`` /
  ``num_local_experts``: ``transformers`` maps one onto the other); both must agree."""
  other = "num_local_experts" if own == "num_experts" else "num_experts"
  values = {key: r.int(key, null_default=False) for key in (own, other) if key in r.d}
  if len(set(values.values())) > 1:
    raise ValueError(f"{r.source}: num_experts and num_local_experts disagree: {values}")
  return next(iter(values.values()), default)


def _read_moe(r: _Reader, model_type: str, defaults: dict) -> dict[str, Any]:
  """The :class:`DecoderConfig` MoE fields of a ``qwen3_moe`` / ``mixtral`` config."""
  d, source = r.d, r.source
  # A null MoE key is refused, never read as the default (transformers refuses it too).
  coef = r.float("router_aux_loss_coef", defaults["router_aux_loss_coef"], null_default=False)
  k = r.int("num_experts_per_tok", defaults["num_experts_per_tok"], null_default=False)
  if model_type == "mixtral":
    # Mixtral's attention honours sliding_window (a banded mask); this model attends causally.
    if d.get("sliding_window") is not None:
      raise ValueError(f"{source}: sliding_window must be null or absent for 'mixtral' "
                       f"(sliding-window attention is not supported), got "
                       f"{d['sliding_window']!r}")
    if r.float("router_jitter_noise", 0.0) != 0.0:
      raise ValueError(f"{source}: router_jitter_noise must be 0 (router noise is not "
                       f"supported), got {d['router_jitter_noise']!r}")
    experts = _num_experts(r, "num_local_experts", defaults["num_experts"])
    # The experts are intermediate_size wide; top-k weights always renormalized.
    width = r.int("intermediate_size", required=True)
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=width,
                norm_topk_prob=True, router_aux_loss_coef=coef)
  layers = d.get("mlp_only_layers")
  if layers is None:
    layers = []
  if not isinstance(layers, list) or any(not isinstance(i, int) or isinstance(i, bool)
                                         for i in layers):
    raise r.fail("mlp_only_layers", "a list of layer indices or null", layers)
  return dict(num_experts=_num_experts(r, "num_experts", defaults["num_experts"]),
              num_experts_per_tok=k,
              moe_intermediate_size=r.int("moe_intermediate_size",
                                          defaults["moe_intermediate_size"],
                                          null_default=False),
              norm_topk_prob=r.bool("norm_topk_prob", defaults["norm_topk_prob"]),
              decoder_sparse_step=r.int("decoder_sparse_step", defaults["decoder_sparse_step"],
                                        null_default=False),
              mlp_only_layers=tuple(sorted(set(layers))), router_aux_loss_coef=coef)


def _freeze(x):
  """Makes nested lists / dicts hashable (the config is a static, hashable dataclass)."""
  if isinstance(x, dict):
    return tuple((k, _freeze(v)) for k, v in sorted(x.items()))
  if isinstance(x, list | tuple):
    return tuple(_freeze(v) for v in x)
  return x


def _thaw_extra(extra: tuple) -> dict[str, Any]:
  return {k: _thaw(v) for k, v in extra}


def _thaw(x):
  if isinstance(x, tuple):
    if x and all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) for e in x):
      return {k: _thaw(v) for k, v in x}
    return [_thaw(v) for v in x]
  return x


_LLAMA3_ROPE = ("llama3", 32.0, 1.0, 4.0, 8192)

#: The public ``config.json`` of each preset (the shapes and numerics that matter).
PRESETS: dict[str, DecoderConfig] = {
    "qwen2.5-0.5b": DecoderConfig(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=True,
        tie_word_embeddings=True, max_position_embeddings=32768,
        extra=(("bos_token_id", 151643), ("eos_token_id", 151643))),
    "qwen2.5-1.5b": DecoderConfig(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=True,
        tie_word_embeddings=True, max_position_embeddings=131072,
        extra=(("bos_token_id", 151643), ("eos_token_id", 151643))),
    "llama-3.2-1b": DecoderConfig(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        tie_word_embeddings=True, max_position_embeddings=131072,
        extra=(("bos_token_id", 128000), ("eos_token_id", 128001))),
    "llama-3.1-8b": DecoderConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=("llama3", 8.0, 1.0, 4.0, 8192),
        tie_word_embeddings=False, max_position_embeddings=131072,
        extra=(("bos_token_id", 128000), ("eos_token_id", 128001))),
    "qwen3-8b": DecoderConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, tie_word_embeddings=False,
        max_position_embeddings=40960,
        extra=(("bos_token_id", 151643), ("eos_token_id", 151645))),
    "qwen3-30b-a3b": DecoderConfig(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, tie_word_embeddings=False,
        max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
        router_aux_loss_coef=0.001,
        extra=(("bos_token_id", 151643), ("eos_token_id", 151645))),
    "mixtral-8x7b": DecoderConfig(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
        max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336, norm_topk_prob=True, router_aux_loss_coef=0.02,
        extra=(("bos_token_id", 1), ("eos_token_id", 2))),
}


def config(name: str, **overrides) -> DecoderConfig:
  """The :class:`DecoderConfig` of preset ``name`` (see :data:`PRESETS`), with fields
  replaced by ``overrides`` (e.g. ``num_hidden_layers=2`` for a shallow copy)."""
  if name not in PRESETS:
    raise ValueError(f"models.config: name must be one of {sorted(PRESETS)}, got {name!r}")
  return dataclasses.replace(PRESETS[name], **overrides)
