"""``linear_logp``: LM-head projection + selected-token log-prob (+ entropy), fused.

Contract: logp and entropy rows are bitwise batch-, position-, padding-,
chunk-, mode- and TP-invariant for every implementation but ``"xla"``; dH rows
batch-invariant; dW and db deterministic run to run. One dispatch table,
:data:`BACKENDS`: an implementation name means that backend's forward *and*
backward.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_kernels import _backend, _validation, contract
from jaxrl_kernels.linear_logp import cpu, gemm_backward, three_gemm, xla
from jaxrl_kernels.linear_logp.config import BackwardConfig
from jaxrl_kernels.pallas import linear_logp_bwd, linear_logp_fwd, linear_logp_mosaic
from jaxrl_kernels.pallas import lm_head_logits as pallas_logits
from jaxrl_kernels.pallas import softmax_partials as sp

_OP = "linear_logp"
_FLOAT_DTYPES = _validation.FLOAT_DTYPES
LAYOUTS = ("hv", "vh")
VOCAB_TILE = contract.VOCAB_TILE


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation of the op: every kernel it runs, forward and backward.

  Attributes:
    name: the implementation name.
    tile_partials: ``(hidden2d, weight, bias, targets, *, layout, temperature,
      compute_dtype, vocab_offset, valid_vocab, entropy) -> (m, s, u, target_logit)``.
      ``entropy=False`` (the caller returns no entropy) lets a kernel leave ``u`` out
      (zeros); ``m``, ``s`` and the target logit keep their bits either way.
    merge_partials: ``(m, s, u) -> (lse, mean_z, entropy)``.
    backward: ``(hidden, weight, bias, targets, lse, mean_z, g_logp, g_ent, *,
      layout, temperature, compute_dtype, vocab_offset, valid_vocab, config, entropy)
      -> (dh, dw, db)``. ``entropy=False``: ``g_ent`` is zero (no entropy was returned),
      so a kernel may leave the entropy term out.
    logits: ``(hidden2d, weight, bias, *, layout, temperature, compute_dtype,
      return_stats) -> z`` or ``(z, (m, s, u))``, each logit bitwise the one
      ``tile_partials`` reduces.
    partials_from_logits: ``(logits2d, targets, *, compute_dtype) -> (m, s, u,
      target_logit)`` as ``tile_partials`` would give them for those logits, or
      None when the implementation has none.
    logits_draw: ``(hidden2d, weight, bias, seed, *, layout, temperature,
      compute_dtype) -> (tokens, token_logits, (m, s, u))``, a token per row drawn in the
      logits kernel (``pallas.draw``) with ``logits``' statistics, or None (the draw then
      runs on the stored logits).
    dlogits: ``(z, lse, mean_z, g_logp, g_ent, targets, *, inv_temperature, entropy) ->
      dz``, the backward's logit gradient of stored float32 logits (from ``logits``): the
      three-GEMM objective (``three_gemm.py``) runs on ``logits``, ``merge_partials`` and
      it; None where the implementation has none.
  """

  name: str
  tile_partials: Callable
  merge_partials: Callable
  backward: Callable
  logits: Callable
  partials_from_logits: Callable | None = None
  logits_draw: Callable | None = None
  dlogits: Callable | None = None


def _pallas_backward(*args, gemm: str, interpret: bool, default_kernel: str,
                     config: BackwardConfig | None, entropy: bool = True, **kw):
  cfg = config or BackwardConfig()
  if (cfg.kernel or default_kernel) == "fused":
    # The fused kernel keeps the entropy term (g_ent = 0 makes it zero).
    return linear_logp_bwd.backward(*args, interpret=interpret, chunk=cfg.chunk, **kw)
  return gemm_backward.backward(*args, gemm=gemm, chunk=cfg.chunk or 4096, dh_rows=cfg.dh_rows,
                                accumulate=cfg.accumulate, fuse_dz=cfg.fuse_dz,
                                entropy=entropy, **kw)


def _reduces_entropy(f: Callable) -> Callable:
  """A backend kernel that computes the entropy's terms whatever ``entropy`` says: the
  argument lets a kernel leave them out (:class:`Backend`); this one keeps them."""

  def call(*args, entropy: bool = True, **kw):
    del entropy
    return f(*args, **kw)

  return call


def _triton_backend(name: str, interpret: bool) -> Backend:
  return Backend(
      name=name,
      tile_partials=_reduces_entropy(
          functools.partial(linear_logp_fwd.tile_partials, interpret=interpret)),
      merge_partials=functools.partial(linear_logp_fwd.merge_partials, interpret=interpret),
      backward=functools.partial(_pallas_backward, gemm=name, interpret=interpret,
                                 default_kernel="fused"),
      logits=functools.partial(pallas_logits.logits, interpret=interpret),
      partials_from_logits=functools.partial(pallas_logits.partials_from_logits,
                                             interpret=interpret),
      dlogits=three_gemm.dlogits)


_MOSAIC = Backend(
    name="mosaic",
    tile_partials=linear_logp_mosaic.tile_partials,
    # The merge is O(tiles x T) and memory-bound: the Triton kernel.
    merge_partials=functools.partial(linear_logp_fwd.merge_partials, interpret=False),
    backward=functools.partial(_pallas_backward, gemm="mosaic", interpret=False,
                               default_kernel="gemm"),
    logits=linear_logp_mosaic.logits,
    partials_from_logits=lambda z, t, *, compute_dtype: linear_logp_mosaic.partials_from_logits(
        z, t),
    logits_draw=linear_logp_mosaic.logits_draw,
    dlogits=three_gemm.dlogits)


def _cpu_backend() -> Backend:
  def backward(*args, config=None, entropy=True, **kw):
    del config, entropy  # one backward, with the entropy term
    return cpu.backward(*args, **kw)

  return Backend(name="cpu", tile_partials=_reduces_entropy(cpu.tile_partials),
                 merge_partials=cpu.merge_partials, backward=backward, logits=cpu.logits,
                 partials_from_logits=cpu.partials_from_logits, dlogits=cpu.dlogits)


def _no_partials(*args, **kwargs):
  raise ValueError(f"{_OP}: implementation 'xla' is the materialized baseline "
                   f"(linear_logp/xla.py, JAX's own autodiff): it has no per-tile partials or "
                   f"backward kernels; use one of {PARTIAL_IMPLEMENTATIONS}")


# "xla": the materialized baseline (linear_logp/xla.py). linear_logp runs it itself; every
# partials entry point refuses it by name.
_XLA = Backend(name="xla", tile_partials=_no_partials, merge_partials=_no_partials,
               backward=_no_partials, logits=_no_partials)

# The one dispatch table: implementation name -> backend record.
BACKENDS: dict[str, Backend] = {
    "mosaic": _MOSAIC,
    "triton": _triton_backend("triton", interpret=False),
    "interpret": _triton_backend("interpret", interpret=True),
    "cpu": _cpu_backend(),
    "xla": _XLA,
}
IMPLEMENTATIONS = tuple(BACKENDS)
#: Implementations with a vocab-parallel (partials) form.
PARTIAL_IMPLEMENTATIONS = tuple(i for i in IMPLEMENTATIONS if i != "xla")


def backend(implementation: str) -> Backend:
  """The :class:`Backend` of a partials implementation (not ``"xla"``)."""
  if implementation not in PARTIAL_IMPLEMENTATIONS:
    raise ValueError(f"{_OP}: implementation must be one of {PARTIAL_IMPLEMENTATIONS}, got "
                     f"{implementation!r}")
  return BACKENDS[implementation]


def resolve(op: str, implementation: str | None, compute_dtype, *,
            supported: tuple[str, ...] = IMPLEMENTATIONS) -> str:
  """The implementation to run: ``implementation``, or the device's default."""
  return _backend.resolve(op, implementation, compute_dtype, supported=supported)


# ---------------------------------------------------------------- partials (the TP pieces)


def tile_partials(hidden2d: jax.Array, weight: jax.Array, bias: jax.Array | None,
                  targets: jax.Array, *, weight_layout: str = "hv", temperature=1.0,
                  compute_dtype=None, implementation: str | None = None, vocab_offset: int = 0,
                  valid_vocab: int | None = None):
  """Per-vocab-tile float32 partials of ``z = (hidden2d @ W + b) / temperature``.

  Args:
    hidden2d: ``[T, H]``.
    weight: this shard's ``[H, V_s]`` (``"hv"``) or ``[V_s, H]`` (``"vh"``),
      holding global vocab ids ``[vocab_offset, vocab_offset + V_s)``.
    bias: ``[V_s]`` or None.
    targets: ``[T]`` int32 *global* ids.
    temperature: a float > 0 or a float32 scalar (traced or not).
    compute_dtype: product dtype (default: ``weight.dtype``; float32 for an
      fp32 head). Accumulation is float32.
    implementation: a partials implementation or None (as ``linear_logp``
      picks). Each gives its own bits; within one, the contract holds.
    vocab_offset: a multiple of ``VOCAB_TILE`` for bitwise TP invariance.
    valid_vocab: local columns ``>= valid_vocab`` are padding (masked to -inf).

  Returns:
    ``(m, s, u, target_logit)``: ``[ceil(V_s / VOCAB_TILE), T]`` float32 tile
    max, ``sum exp(z - m)`` and ``sum exp(z - m) (z - m)``; ``[T]`` float32
    target logit, exactly 0 on rows whose target this shard does not own (so
    a sum over shards is exact).
  """
  compute_dtype = jnp.dtype(compute_dtype or weight.dtype)
  impl = resolve("tile_partials", implementation, compute_dtype,
                 supported=PARTIAL_IMPLEMENTATIONS)
  temp = _temperature_arg(_validation.as_temperature("tile_partials", temperature))
  return backend(impl).tile_partials(
      hidden2d, weight, bias, targets, layout=weight_layout,
      temperature=1.0 if temp is None else temp,
      compute_dtype=compute_dtype, vocab_offset=vocab_offset, valid_vocab=valid_vocab)


def merge_partials(m: jax.Array, s: jax.Array, u: jax.Array, *,
                   implementation: str | None = None):
  """Folds ``[n_tiles, T]`` partials in ascending tile order.

  Returns float32 ``(lse, mean_z, entropy)``, each ``[T]``, with
  ``lse = logsumexp(z)``, ``mean_z = sum softmax(z) z``, ``entropy = lse - mean_z``.
  """
  # The partials are float32 for every implementation (the products' dtype is gone).
  impl = _backend.resolve("merge_partials", implementation, jnp.float32,
                          supported=PARTIAL_IMPLEMENTATIONS,
                          mosaic_dtypes=("bfloat16", "float16", "float32"))
  return backend(impl).merge_partials(m, s, u)


finalize = sp.finalize


# ---------------------------------------------------------------------- validation


def check_targets(targets, vocab_size: int, mask=None) -> None:
  """Checks that every active target id lies in ``[0, vocab_size)``.

  Concrete arrays: raises ``ValueError`` naming the first bad position. Traced
  arrays: emits a ``jax.experimental.checkify`` check (run the function under
  ``checkify.checkify`` to get the error out of ``jit``). Positions where
  ``mask`` is False are ignored (their ids may be anything, e.g. -100). Float
  ids and a non-integer ``vocab_size`` are TypeErrors.

  >>> import jax.numpy as jnp
  >>> check_targets(jnp.array([0, 3, -100]), 4, mask=jnp.array([True, True, False]))
  """
  vocab_size = _validation.check_int("check_targets", "vocab_size", vocab_size, minimum=1)
  ids = _validation.as_ids("check_targets", "targets", targets)
  mask = _validation.as_mask("check_targets", "mask", mask, ids.shape)
  _validation.check_ids_in_range("check_targets", "targets", ids, vocab_size, mask)


@dataclasses.dataclass(frozen=True)
class Inputs:
  """Validated ``linear_logp`` arguments (arrays as jax arrays, ids int32, mask bool)."""

  hidden: jax.Array
  weight: jax.Array
  targets: jax.Array
  bias: jax.Array | None
  mask: jax.Array | None
  temperature: float | jax.Array
  compute_dtype: jnp.dtype
  vocab_size: int


def validate(op: str, hidden, weight, targets, *, bias, mask, temperature, weight_layout,
             fp32_head, return_entropy) -> Inputs:
  """Checks and normalizes the arguments of ``linear_logp`` and its TP form."""
  _validation.check_choice(op, "weight_layout", weight_layout, LAYOUTS)
  _validation.check_bool(op, "fp32_head", fp32_head)
  _validation.check_bool(op, "return_entropy", return_entropy)
  hidden = jnp.asarray(hidden)
  weight = jnp.asarray(weight)
  if hidden.ndim < 1:
    raise ValueError(f"{op}: hidden must be [..., H], got shape {hidden.shape}")
  if weight.ndim != 2:
    raise ValueError(f"{op}: weight must be 2-D ([H, V] for 'hv', [V, H] for 'vh'), got "
                     f"shape {weight.shape}")
  _validation.check_float_array(op, "hidden", hidden)
  _validation.check_float_array(op, "weight", weight)
  if hidden.dtype != weight.dtype and not fp32_head:
    raise TypeError(f"{op}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must have "
                    f"the same dtype unless fp32_head=True; cast one explicitly")
  h_w, v = weight.shape if weight_layout == "hv" else weight.shape[::-1]
  if hidden.shape[-1] != h_w:
    raise ValueError(f"{op}: hidden has {hidden.shape[-1]} features but weight "
                     f"{weight.shape} ({weight_layout!r}) has {h_w}")
  if v == 0:
    raise ValueError(f"{op}: the vocabulary is empty (weight shape {weight.shape})")
  targets = _validation.as_ids(op, "targets", targets, shape=hidden.shape[:-1])
  mask = _validation.as_mask(op, "mask", mask, targets.shape)
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (v,):
      raise ValueError(f"{op}: bias must have shape ({v},), got {bias.shape}")
    _validation.check_float_array(op, "bias", bias)
  temperature = _validation.as_temperature(op, temperature)
  compute_dtype = jnp.dtype(jnp.float32 if fp32_head else hidden.dtype)
  return Inputs(hidden, weight, targets, bias, mask, temperature, compute_dtype, v)


def rows(op: str, x: Inputs):
  """``(lead, T, hidden [T, H], targets [T], mask [T] or None)`` of validated inputs, the
  token axes flattened. Concrete active ids outside ``[0, V)`` raise here (eager calls fail
  loudly); traced ones give NaN."""
  if _validation.is_concrete(x.targets, x.mask):
    _validation.check_ids_in_range(op, "targets", x.targets, x.vocab_size, x.mask)
  lead = x.targets.shape
  t = math.prod(lead)
  m2 = None if x.mask is None else x.mask.reshape(t)
  return lead, t, x.hidden.reshape(t, x.hidden.shape[-1]), x.targets.reshape(t), m2


def zero_masked_rows(hidden2d: jax.Array, mask: jax.Array | None) -> jax.Array:
  """Masked rows replaced by zeros (a select): whatever they hold (NaN, inf) then
  reaches no output and no gradient, and the rows' own gradient is exactly 0."""
  if mask is None:
    return hidden2d
  return jnp.where(mask[:, None], hidden2d, jnp.zeros((), hidden2d.dtype))


def with_features(hidden2d: jax.Array, weight: jax.Array, layout: str):
  """H = 0 as one zero feature: every product is then exactly 0 and the logits
  are ``b / temperature``, as the empty sum says. Kernels need H >= 1."""
  if hidden2d.shape[1]:
    return hidden2d, weight
  v = weight.shape[1] if layout == "hv" else weight.shape[0]
  w = jnp.zeros((1, v) if layout == "hv" else (v, 1), weight.dtype)
  return jnp.zeros((hidden2d.shape[0], 1), hidden2d.dtype), w


# ---------------------------------------------------------------------- the fused op


@dataclasses.dataclass(frozen=True)
class _Static:
  layout: str
  compute_dtype: str
  implementation: str
  vocab_size: int
  config: BackwardConfig | None
  entropy: bool  # the caller returns the entropy (else its terms may be left out)


def _temperature_arg(temperature):
  """1.0 stays static (no division); any other value is a float32 operand."""
  return sp.temperature_scalar(temperature)


def _forward(hidden, weight, bias, temp, targets, mask, st: _Static):
  be = backend(st.implementation)
  t_arg = 1.0 if temp is None else temp
  m, s, u, tz = be.tile_partials(hidden, weight, bias, targets, layout=st.layout,
                                 temperature=t_arg, compute_dtype=st.compute_dtype,
                                 entropy=st.entropy)
  lse, mean_z, ent = be.merge_partials(m, s, u)
  logp, ent = sp.finalize(tz, lse, ent, targets, mask, st.vocab_size)
  return (logp, ent), (lse, mean_z)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fused(hidden, weight, bias, temp, targets, mask, st):
  return _forward(hidden, weight, bias, temp, targets, mask, st)[0]


def _fused_fwd(hidden, weight, bias, temp, targets, mask, st):
  # The very same kernels as the primal: forward-only and training bits agree.
  out, (lse, mean_z) = _forward(hidden, weight, bias, temp, targets, mask, st)
  return out, (hidden, weight, bias, temp, targets, mask, lse, mean_z)


def masked_cotangents(cts, targets, mask, vocab_size: int):
  """float32 ``(g_logp, g_ent)``: NaN for active out-of-range targets (their
  logp is NaN), selected to 0 at masked rows."""
  g_logp, g_ent = (jnp.asarray(c, jnp.float32) for c in cts)
  invalid = (targets < 0) | (targets >= vocab_size)
  g_logp = jnp.where(invalid & (g_logp != 0), jnp.nan, g_logp)
  if mask is not None:
    g_logp = jnp.where(mask, g_logp, 0.0)
    g_ent = jnp.where(mask, g_ent, 0.0)
  return g_logp, g_ent


def _fused_bwd(st, res, cts):
  hidden, weight, bias, temp, targets, mask, lse, mean_z = res
  g_logp, g_ent = masked_cotangents(cts, targets, mask, st.vocab_size)
  dh, dw, db = backend(st.implementation).backward(
      hidden, weight, bias, targets, lse, mean_z, g_logp, g_ent, layout=st.layout,
      temperature=1.0 if temp is None else temp, compute_dtype=st.compute_dtype,
      config=st.config, entropy=st.entropy)
  db = None if bias is None else db.astype(bias.dtype)
  # No gradient flows to the temperature (a schedule, not a parameter).
  return dh.astype(hidden.dtype), dw.astype(weight.dtype), db, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


@_validation.keyword_mask
def linear_logp(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *,
                bias: jax.Array | None = None, temperature: float | jax.Array = 1.0,
                mask: jax.Array | None = None, return_entropy: bool = False,
                weight_layout: str = "hv", fp32_head: bool = False,
                implementation: str | None = None, config: BackwardConfig | None = None):
  """Selected-token log-probs (and entropy) of an LM head, without the logits.

  With ``z = (hidden @ W + bias) / temperature`` (float32 accumulation):
  ``logp = z[t] - logsumexp(z)`` and ``entropy = logsumexp(z) - sum softmax(z) z``.
  The ``[..., V]`` logits never exist: the kernels reduce each
  ``VOCAB_TILE``-wide tile of them to float32 partials and merge those in a
  fixed order, so logp and entropy are bitwise batch-, position-, padding-,
  chunk- and mode-invariant (CONTRACT.md section 1) for every implementation
  except ``"xla"``.

  Args:
    hidden: ``[..., H]`` float (bf16, fp16 or fp32).
    weight: ``[H, V]`` (``weight_layout="hv"``, a Dense kernel) or ``[V, H]``
      (``"vh"``, a tied embedding table, read in place).
    targets: ``[...]`` integer ids (lists accepted; ids that do not fit int32
      are refused). Active ids outside ``[0, V)`` give NaN (and raise here
      when ``targets`` is concrete; see :func:`check_targets`).
    bias: ``[V]`` or None.
    temperature: a float > 0, or a float32 scalar that may be traced (annealed
      inside ``jit``): a value gives the same bits static or traced. No
      gradient flows to it.
    mask: ``[...]`` bool, or 0/1 integers or floats, or None; False positions
      return 0, and their rows (whatever they hold, NaN included) reach no
      output and no gradient.
    return_entropy: also return the entropy.
    weight_layout: ``"hv"`` or ``"vh"``.
    fp32_head: compute the projection from float32-upcast hidden and weight
      tiles (hidden and weight may then differ in dtype); gradients keep the
      parameters' dtypes.
    implementation: ``"mosaic"`` (Hopper, bf16/fp16 products: TMA + wgmma
      forward, Mosaic GEMM backward; the default there), ``"triton"`` (Triton
      kernels throughout; the default on other GPUs and for fp32 heads),
      ``"cpu"`` (the CPU default), ``"interpret"`` (the Triton kernels under
      the Pallas interpreter), ``"xla"`` (materialized; not invariant) or None.
      Each implementation has its own bits; the invariances hold within one.
    config: :class:`BackwardConfig` (the backward's free knobs) or None.

  Returns:
    float32 ``logp`` of shape ``targets.shape``, or ``(logp, entropy)``.

  Gradients (``jax.custom_vjp``) w.r.t. hidden, weight and bias from both
  outputs: ``dz = (g_logp (onehot - p) - g_ent p (z - sum p z)) / temperature``,
  with logits recomputed tile by tile (residuals: two float32 per token).
  dH rows are batch-invariant; dW and db are deterministic run to run.
  Forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``) is not supported: the
  op is a ``custom_vjp``; use reverse mode.

  >>> import jax.numpy as jnp, numpy as np
  >>> h = jnp.zeros((2, 4)); w = jnp.zeros((4, 8)); t = jnp.array([1, 5])
  >>> np.asarray(linear_logp(h, w, t, implementation="interpret"), np.float64).round(4).tolist()
  [-2.0794, -2.0794]
  """
  x = validate(_OP, hidden, weight, targets, bias=bias, mask=mask, temperature=temperature,
               weight_layout=weight_layout, fp32_head=fp32_head,
               return_entropy=return_entropy)
  if config is not None and not isinstance(config, BackwardConfig):
    raise TypeError(f"{_OP}: config must be a BackwardConfig or None, got {config!r}")
  impl = resolve(_OP, implementation, x.compute_dtype)
  lead, t, h2, t2, m2 = rows(_OP, x)
  if t == 0:
    logp = ent = jnp.zeros((0,), jnp.float32)
  else:
    h2, w = with_features(zero_masked_rows(h2, m2), x.weight, weight_layout)
    temp = _temperature_arg(x.temperature)
    if impl == "xla":
      logp, ent = xla.linear_logp(h2, w, x.bias, t2, m2, layout=weight_layout,
                                  temperature=1.0 if temp is None else temp,
                                  compute_dtype=x.compute_dtype)
    else:
      st = _Static(weight_layout, x.compute_dtype.name, impl, x.vocab_size, config,
                   bool(return_entropy))
      logp, ent = _fused(h2, w, x.bias, temp, t2, m2, st)
  logp = logp.reshape(lead)
  ent = ent.reshape(lead)
  return (logp, ent) if return_entropy else logp
