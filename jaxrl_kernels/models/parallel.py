"""Whole models sharded over a mesh (tensor, fully sharded data, and data parallel) with the
unsharded model's bits: :class:`Parallelism`, :func:`shard`, :class:`ShardedDecoderLM`.

The model runs under ``shard_map`` with explicit collectives, and every per-token output
(hidden states, log-probs, the sampler's logits and statistics) is bitwise the unsharded
:class:`~jaxrl_kernels.models.DecoderLM`'s, for every (tp, fsdp, dp) layout:

* **tp** (tensor parallel, for rollout). ``qkv_proj`` and ``gate_up_proj`` (packed per KV
  head and per MLP column pair, see ``models.decoder``) are
  column-parallel: each device holds its heads' (its MLP columns') weights, and a column's
  bits do not depend on how many columns sit beside it. Key/value heads are split whole
  (tp divides ``num_key_value_heads``), so each GQA group and its query heads live on one
  device; q/k norms and rotary are per head. ``o_proj`` and ``down_proj`` are row-parallel
  through :func:`~jaxrl_kernels.gemm.row_parallel_matmul`, whose canonical K order is the
  unsharded layer's. The embedding is split over the vocabulary: each device reads the rows
  it owns and writes ``-0.0`` elsewhere, and a ``psum`` of one value and ``-0.0``s is that
  value exactly. The head is :func:`~jaxrl_kernels.linear_logp.vocab_parallel_linear_logp`
  (its vocabulary zero-padded to the tile grid, ``pad_vocab``). RMSNorm weights are
  replicated.
  A mixture-of-experts layer's experts are split over tp (``expert`` axis; the router is
  replicated): each device computes its experts' assignments of the (replicated) tokens and
  a ``psum`` in which the other devices add ``-0.0`` gives every assignment its owner's
  bits (``moe_mlp(..., tokens_replicated=True)``).
* **fsdp**: every parameter is split over the fsdp axis on its first dimension that tp
  does not split and that the fsdp size divides (replicated when none does); a layer's
  parameters are all-gathered (exact) when the layer runs. The batch is split over
  ``(dp, fsdp)``.
* **dp**: parameters replicated, the batch split.

Each device thus runs the unsharded model's kernels on its rows with its slices of the
weights, and every cross-device combination is either exact (gathers, one-owner sums) or
the canonical tree that the unsharded layer computes too.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_kernels import _compat, rl
from jaxrl_kernels.linear_logp import LogitStats, padded_vocab_size, vocab_parallel_linear_logp
from jaxrl_kernels.linear_logp import api as linear_logp_api
from jaxrl_kernels.models.decoder import DecoderLM, MoEMLP, RowParallelLinear
from jaxrl_kernels.nn.protocol import (
  KVCache,
  check_decode_token,
  check_prefill,
  check_token_ids,
)
from jaxrl_kernels.reduce.segment import take_rows

#: Logical axes (the ``logical_axes`` metadata of ``DecoderLM``'s parameters) split over tp.
TP_LOGICAL_AXES = ("vocab", "q_heads", "kv_heads", "expert", "mlp")
MERGES = ("canonical", "psum")
_OP = "ShardedDecoderLM"


@dataclasses.dataclass(frozen=True)
class Parallelism:
  """Which mesh axis plays which role (None: the role is absent, size 1).

  Attributes:
    mesh: the device mesh.
    tp: tensor-parallel axis (rollout): heads, MLP columns and vocabulary split.
    fsdp: fully sharded data-parallel axis (training): parameters split, gathered per
      layer; the batch split.
    dp: data-parallel axis: parameters replicated, the batch split.

  Every mesh axis of size > 1 must have a role; no axis may have two.
  """

  mesh: Mesh
  tp: str | None = None
  fsdp: str | None = None
  dp: str | None = None

  def __post_init__(self):
    if not isinstance(self.mesh, Mesh):
      raise TypeError(f"Parallelism: mesh must be a jax.sharding.Mesh, got "
                      f"{type(self.mesh).__name__}")
    names = self.mesh.axis_names
    seen: dict[str, str] = {}
    for role in ("tp", "fsdp", "dp"):
      axis = getattr(self, role)
      if axis is None:
        continue
      if axis not in names:
        raise ValueError(f"Parallelism: {role}={axis!r} is not an axis of the mesh (its axes "
                         f"are {names})")
      if axis in seen:
        raise ValueError(f"Parallelism: {seen[axis]} and {role} both name mesh axis {axis!r}; "
                         f"each axis has one role")
      seen[axis] = role
    for axis in names:
      if axis not in seen and self.mesh.shape[axis] > 1:
        raise ValueError(f"Parallelism: mesh axis {axis!r} (size {self.mesh.shape[axis]}) has "
                         f"no role; name it as tp, fsdp or dp")

  def size(self, role: str) -> int:
    """The number of devices along ``role``'s axis (1 when the role is absent)."""
    axis = getattr(self, role)
    return 1 if axis is None else int(self.mesh.shape[axis])

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The mesh axes the batch is split over, major first: ``(dp, fsdp)``."""
    return tuple(a for a in (self.dp, self.fsdp) if a is not None)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static layout of a sharded model (part of the jit cache key)."""

  par: Parallelism
  merge: str
  vocab_size: int
  local_vocab: int  # vocabulary rows per tp device (after padding)

  @property
  def tp(self) -> int:
    return self.par.size("tp")

  @property
  def fsdp(self) -> int:
    return self.par.size("fsdp")

  @property
  def vocab_parallel(self) -> bool:
    """Embedding and head run their vocabulary-parallel code (a tp axis is named, even
    of size 1: the one-device check of that code path)."""
    return self.par.tp is not None

  @property
  def batch(self) -> PartitionSpec:
    axes = self.par.batch_axes
    return PartitionSpec(axes if axes else None)

  def batch_spec(self, ndim: int) -> PartitionSpec:
    """A ``[B, ...]`` array of ``ndim`` dimensions split over the batch axes."""
    return PartitionSpec(*self.batch, *([None] * (ndim - 1)))

  @property
  def cache_spec(self) -> PartitionSpec:
    """KV-cache ``[B, S, Hkv, d]``: the batch over (dp, fsdp), the kv heads over tp."""
    return PartitionSpec(*self.batch, None, self.par.tp, None)


# --------------------------------------------------------------------------- parameters


def _param_spec(var: nnx.Variable) -> PartitionSpec:
  meta = var.get_metadata()
  ndim = len(var.get_value().shape)
  parts: list = [None] * ndim
  for key in ("tp", "fsdp"):
    dim = meta.get(f"{key}_dim")
    if dim is not None:
      parts[dim] = meta[f"{key}_axis"]
  return PartitionSpec(*parts)


def _layout_param(path, var: nnx.Variable, plan: _Plan) -> jax.Array:
  """Pads a vocabulary dimension for tp, records the tp and fsdp dimensions in the
  variable's metadata and returns the padded value."""
  value = jnp.asarray(var.get_value())
  axes = var.get_metadata().get("logical_axes")
  if axes is None or len(axes) != value.ndim:
    raise ValueError(f"shard: parameter {'.'.join(map(str, path))} carries no logical_axes "
                     f"metadata for its {value.ndim} dimensions")
  par = plan.par
  tp_dim = None
  if plan.vocab_parallel:
    tp_dims = [d for d, a in enumerate(axes) if a in TP_LOGICAL_AXES]
    tp_dim = tp_dims[0] if tp_dims else None
  if tp_dim is not None and axes[tp_dim] == "vocab":
    pad = plan.tp * plan.local_vocab - value.shape[tp_dim]
    widths = [(0, 0)] * value.ndim
    widths[tp_dim] = (0, pad)
    value = jnp.pad(value, widths)
  local = list(value.shape)
  if tp_dim is not None:
    local[tp_dim] //= plan.tp
  fsdp_dim = None
  if plan.fsdp > 1:
    fsdp_dim = next((d for d in range(value.ndim)
                     if d != tp_dim and local[d] % plan.fsdp == 0), None)
  var.set_metadata(tp_dim=tp_dim, tp_axis=par.tp, fsdp_dim=fsdp_dim, fsdp_axis=par.fsdp)
  return value


def _gathered(module: nnx.Module, plan: _Plan) -> nnx.Module:
  """A copy of ``module`` (inside ``shard_map``) whose fsdp-split parameters are
  all-gathered: this device's tp slices, whole. Gathers move values without arithmetic."""
  if plan.fsdp == 1:
    return module
  graphdef, state = nnx.split(module)
  flat = []
  for path, var in nnx.to_flat_state(state):
    dim = var.get_metadata().get("fsdp_dim")
    value = var.get_value()
    if dim is not None:
      value = lax.all_gather(value, plan.par.fsdp, axis=dim, tiled=True)
    flat.append((path, var.replace(value)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


class _FsdpLayer(nnx.Module):
  """A decoder layer holding this device's fsdp shards, gathered when it runs (and, under
  ``remat``, gathered again in the backward pass)."""

  def __init__(self, layer: nnx.Module, plan: _Plan):
    self.layer = layer
    self.plan = plan

  def __call__(self, x, positions, docs):
    return _gathered(self.layer, self.plan)(x, positions, docs)

  def decode(self, x, cache_k, cache_v, lengths, pending=None, weights=None):
    return _gathered(self.layer, self.plan).decode(x, cache_k, cache_v, lengths, pending,
                                                   weights)


class _VocabParallelEmbed:
  """The embedding lookup with the ``[V_p, H]`` table split over tp (inside ``shard_map``):
  the owner of a token writes its row, the others ``-0.0``; the ``psum`` is exact."""

  def __init__(self, embed: nnx.Embed, plan: _Plan):
    self.embed = embed
    self.plan = plan

  def __call__(self, tokens: jax.Array) -> jax.Array:
    plan = self.plan
    table = self.embed.embedding.get_value()
    dtype = self.embed.dtype or table.dtype
    lo = lax.axis_index(plan.par.tp) * plan.local_vocab
    local = tokens.astype(jnp.int32) - lo
    owned = (local >= 0) & (local < plan.local_vocab)
    # take_rows: jnp.take whose gradient adds the tokens' rows in a fixed order (no atomics).
    rows = take_rows(table.astype(dtype), jnp.clip(local, 0, plan.local_vocab - 1))
    rows = jnp.where(owned[..., None], rows, jnp.asarray(-0.0, dtype))
    return lax.psum(rows, plan.par.tp)


class _VocabParallelHead:
  """The LM head with the vocabulary split over tp (inside ``shard_map``): log-probs by
  ``vocab_parallel_linear_logp``; logits (and their statistics) by the head's own logits
  kernel on this device's columns, gathered."""

  def __init__(self, head, plan: _Plan):
    self.head = head
    self.plan = plan

  def __call__(self, h, targets, mask=None, temperature=1.0, return_entropy=False):
    head, plan = self.head, self.plan
    return vocab_parallel_linear_logp(
        head.hidden(h), head.weight(), targets, axis_name=plan.par.tp,
        vocab_size=plan.vocab_size, mask=mask, bias_shard=head.bias_value(),
        temperature=temperature, return_entropy=return_entropy,
        weight_layout=head.weight_layout, fp32_head=head.fp32_head,
        merge="psum" if plan.merge == "psum" else "all_gather",
        implementation=head.implementation)

  def policy_loss(self, h, targets, mask=None, *, temperature=1.0, **objective):
    """:func:`jaxrl_kernels.rl.linear_policy_loss` on this device's vocabulary shard
    (``vocab_axis``): ``logp``, ``entropy`` and the loss bitwise the unsharded head's."""
    head, plan = self.head, self.plan
    return rl.linear_policy_loss(
        head.hidden(h), head.weight(), targets, mask=mask, bias=head.bias_value(),
        temperature=temperature, weight_layout=head.weight_layout, fp32_head=head.fp32_head,
        implementation=head.implementation, vocab_axis=plan.par.tp,
        vocab_size=plan.vocab_size, merge="psum" if plan.merge == "psum" else "all_gather",
        **objective)

  def logits(self, h, temperature=1.0, return_stats=False):
    """float32 ``[..., V]`` logits, each bitwise the unsharded head's (one H-reduction per
    logit, computed by the same kernel on the same column). With ``return_stats``: the
    per-tile softmax partials of every device, gathered in ascending global tile order and
    folded by the unsharded merge, so ``lse`` and the entropy are the unsharded
    ``head.logits(..., return_stats=True)``'s (and the trainer's) bits."""
    head, plan = self.head, self.plan
    hidden = head.hidden(h)
    lead, hd = hidden.shape[:-1], hidden.shape[-1]
    h2 = hidden.reshape(math.prod(lead), hd)
    compute = jnp.dtype(head.compute_dtype)
    impl = linear_logp_api.resolve("head_logits", head.implementation, compute,
                                   supported=linear_logp_api.PARTIAL_IMPLEMENTATIONS)
    be = linear_logp_api.backend(impl)
    # As head_logits passes it: 1.0 static, any other value a float32 scalar behind a
    # barrier (XLA would otherwise fold a constant divisor into a reciprocal product).
    temp = (1.0 if isinstance(temperature, int | float) and temperature == 1.0
            else lax.optimization_barrier(jnp.asarray(temperature, jnp.float32)))
    layout = head.weight_layout
    weight, bias = head.weight(), head.bias_value()
    v_s, tile = plan.local_vocab, linear_logp_api.VOCAB_TILE
    n_local = -(-v_s // tile)  # v_s is a multiple of the tile when tp > 1

    def local(valid: int):
      # The kernel sees exactly this device's real columns, as the unsharded kernel sees
      # the last (partial) tile of the vocabulary: the same masking, the same bits.
      w = weight[:, :valid] if layout == "hv" else weight[:valid]
      b = None if bias is None else bias[:valid]
      z, (m, s, u) = be.logits(h2, w, b, layout=layout, temperature=temp,
                               compute_dtype=compute, return_stats=True)
      pad_t = n_local - m.shape[0]
      z = jnp.pad(z, ((0, 0), (0, v_s - valid)))
      m = jnp.pad(m, ((0, pad_t), (0, 0)), constant_values=-jnp.inf)
      s = jnp.pad(s, ((0, pad_t), (0, 0)))
      u = jnp.pad(u, ((0, pad_t), (0, 0)))
      return z, m, s, u

    last = plan.vocab_size - (plan.tp - 1) * v_s  # real columns of the last device
    if last == v_s:
      z, m, s, u = local(v_s)
    else:
      is_last = lax.axis_index(plan.par.tp) == plan.tp - 1
      z, m, s, u = lax.cond(is_last, lambda: local(last), lambda: local(v_s))
    z = lax.all_gather(z, plan.par.tp, axis=1, tiled=True)[:, :plan.vocab_size]
    z = z.reshape(*lead, plan.vocab_size)
    if not return_stats:
      return z
    n_tiles = -(-plan.vocab_size // tile)
    m, s, u = (lax.all_gather(x, plan.par.tp, axis=0, tiled=True)[:n_tiles] for x in (m, s, u))
    lse, _, ent = be.merge_partials(m, s, u)
    return z, LogitStats(lse.reshape(lead), ent.reshape(lead))


def _local_head(head, plan: _Plan):
  head = _gathered(head, plan)
  return _VocabParallelHead(head, plan) if plan.vocab_parallel else head


def _local_model(graphdef, params, plan: _Plan) -> DecoderLM:
  """This device's model inside ``shard_map``: its parameter slices, the fsdp gathers and
  the vocabulary-parallel embedding and head in place."""
  model = nnx.merge(graphdef, params)
  model.layers = nnx.List([_FsdpLayer(layer, plan) for layer in model.layers])
  embed = _gathered(model.embed_tokens, plan)
  model.embed_tokens = _VocabParallelEmbed(embed, plan) if plan.vocab_parallel else embed
  model.norm = _gathered(model.norm, plan)
  model.head = _local_head(model.head, plan)
  return model


def _forward_only(fn):
  """``fn`` with a backward pass that refuses (tensor-parallel training is not offered:
  the row-parallel and vocab-parallel backward passes assume a replicated cotangent)."""

  @jax.custom_vjp
  def f(*args):
    return fn(*args)

  def fwd(*args):
    return fn(*args), None

  def bwd(_, g):
    raise ValueError(f"{_OP}: gradients are supported with fsdp and dp; a model sharded "
                     f"with tp > 1 is forward-only (rollout)")

  f.defvjp(fwd, bwd)
  return f


def _place(x, plan: _Plan, spec: PartitionSpec):
  """``x`` laid out as ``spec``: ``device_put`` for a concrete array; under a trace,
  ``reshard`` on a mesh with Explicit axes (``jax.make_mesh``'s default, whose arrays carry
  their layout in their type) and a sharding constraint on Auto axes."""
  mesh = plan.par.mesh
  sharding = NamedSharding(mesh, spec)
  if not isinstance(x, jax.core.Tracer):
    return x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding)
  if jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())):
    return jax.sharding.reshard(x, sharding)
  return lax.with_sharding_constraint(x, sharding)


def _sharded_call(module: nnx.Module, localize, plan: _Plan, call, arrays: tuple,
                  specs: tuple, out_specs):
  """``call(localize(graphdef, params, plan), *arrays)`` on every device, under
  ``shard_map``: ``module``'s parameters split as their metadata says, ``arrays`` as
  ``specs``. None arrays are passed as None (not through ``shard_map``)."""
  graphdef, state = nnx.split(module)
  params = nnx.to_pure_dict(state)
  live = [i for i, a in enumerate(arrays) if a is not None]

  def body(params, *xs):
    full = [None] * len(arrays)
    for i, x in zip(live, xs, strict=True):
      full[i] = x
    return call(localize(graphdef, params, plan), *full)

  fn = _compat.shard_map(body, mesh=plan.par.mesh,
                         in_specs=(_param_specs(state), *(specs[i] for i in live)),
                         out_specs=out_specs, check_vma=False)
  if plan.tp > 1:
    fn = _forward_only(fn)
  placed = [jax.tree.map(lambda x, sp: _place(jnp.asarray(x), plan, sp), arrays[i], specs[i])
            for i in live]
  return fn(params, *placed)


def _local_head_of(graphdef, params, plan: _Plan):
  return _local_head(nnx.merge(graphdef, params), plan)


# ------------------------------------------------------------------------------ the module


class ShardedHead(nnx.Module):
  """The sharded model's LM head, as ``nn.sample`` reads it (``head.logits(h, temperature,
  return_stats=True)``) and as ``head(h, targets, ...)`` for log-probs: global ``h
  [..., H]`` in (the batch split over ``(dp, fsdp)``), global results out."""

  def __init__(self, head, plan: _Plan):
    self.module = head
    self.plan = plan

  def _run(self, call, arrays: tuple, specs: tuple, out_specs):
    return _sharded_call(self.module, _local_head_of, self.plan, call, arrays, specs,
                         out_specs)

  def logits(self, h: jax.Array, temperature: float = 1.0, return_stats: bool = False):
    """float32 ``[..., V]`` logits (and :class:`~jaxrl_kernels.nn.LogitStats`), bitwise the
    unsharded ``LMHead.logits``."""
    h = jnp.asarray(h)
    _check_batch(self.plan, h.shape[0], "h")
    spec = self.plan.batch_spec(h.ndim)
    out = self.plan.batch_spec(h.ndim)
    stat = self.plan.batch_spec(h.ndim - 1)
    out_specs = (out, LogitStats(stat, stat)) if return_stats else out
    t_arr, t_static = _temperature(temperature)
    if t_arr is None:
      return self._run(lambda head, x: head.logits(x, t_static, return_stats), (h,), (spec,),
                       out_specs)
    return self._run(lambda head, x, t: head.logits(x, t, return_stats), (h, t_arr),
                     (spec, PartitionSpec()), out_specs)

  def __call__(self, h: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
               temperature: float = 1.0, return_entropy: bool = False):
    """float32 log-probs (and entropy) of ``targets`` ``[B, ...]``, bitwise ``LMHead``'s."""
    h = jnp.asarray(h)
    targets = jnp.asarray(targets)
    _check_batch(self.plan, h.shape[0], "h")
    spec = self.plan.batch_spec(targets.ndim)
    out = (spec, spec) if return_entropy else spec
    t_arr, t_static = _temperature(temperature)
    arrays = (h, targets, None if mask is None else jnp.asarray(mask), t_arr)
    specs = (self.plan.batch_spec(h.ndim), spec, spec, PartitionSpec())

    def call(head, x, tgt, mask, temp):
      return head(x, tgt, mask, temperature=t_static if temp is None else temp,
                  return_entropy=return_entropy)

    return self._run(call, arrays, specs, out)


def _temperature(t):
  """``(array, None)`` for a traced or array temperature (passed into ``shard_map``),
  ``(None, value)`` for a Python number."""
  if isinstance(t, int | float) and not isinstance(t, bool):
    return None, float(t)
  return jnp.asarray(t, jnp.float32), None


def _param_specs(state) -> dict:
  flat = {path: _param_spec(var) for path, var in nnx.to_flat_state(state)}
  return traverse_util.unflatten_dict(flat)


def _check_batch(plan: _Plan, b: int, name: str) -> None:
  n = plan.par.size("dp") * plan.par.size("fsdp")
  if b % n:
    raise ValueError(f"{_OP}: the batch dimension of {name} is {b}, which must be divisible "
                     f"by dp x fsdp = {n} (it is split over the mesh axes "
                     f"{plan.par.batch_axes})")


class ShardedDecoderLM(nnx.Module):
  """A :class:`~jaxrl_kernels.models.DecoderLM` whose parameters are placed on a mesh and
  whose every method runs under ``shard_map`` (see the module docstring), with the
  unsharded model's bits. Built by :func:`shard`.

  It follows the ``nn.sampler.CausalLM`` protocol, so ``nn.sample(sharded, ...)`` and
  ``nn.score(sharded, ...)`` run sharded. Arguments and results are global arrays; the
  batch (first) dimension is split over ``(dp, fsdp)`` and must be divisible by their
  product. Gradients (``jax.grad`` / ``nnx.grad`` through :meth:`logp`) flow with fsdp
  and dp; with tp > 1 the model is forward-only.

  Attributes:
    config: the architecture.
    parallelism: the :class:`Parallelism`.
    merge: ``"canonical"`` (bitwise the unsharded model) or ``"psum"`` (the Megatron
      control: row-parallel layers summed with ``psum``, the head's softmax merged per
      shard; its bits depend on the tp degree).
    decoder: the ``DecoderLM`` holding the placed parameters (vocabulary rows zero-padded
      to ``padded_vocab_size(V, tp)``); run it only through this module.
    head: the :class:`ShardedHead`.
  """

  def __init__(self, model: DecoderLM, parallelism: Parallelism, *, merge: str = "canonical"):
    if not isinstance(model, DecoderLM):
      raise TypeError(f"shard: model must be a DecoderLM, got {type(model).__name__}")
    if not isinstance(parallelism, Parallelism):
      raise TypeError(f"shard: parallelism must be a Parallelism, got "
                      f"{type(parallelism).__name__}")
    if merge not in MERGES:
      raise ValueError(f"shard: merge must be one of {MERGES}, got {merge!r}")
    cfg = model.config
    tp = parallelism.size("tp")
    if cfg.num_experts % tp:
      raise ValueError(f"shard: tp={tp} must divide num_experts={cfg.num_experts} (a MoE "
                       f"layer's experts are split over tp)")
    if tp > 1:
      if cfg.num_key_value_heads % tp:
        raise ValueError(f"shard: tp={tp} must divide num_key_value_heads="
                         f"{cfg.num_key_value_heads} (GQA groups are kept whole on a device)")
      if model.row_chunks == 1:
        raise ValueError(f"shard: a model built with row_chunks=1 (plain det_matmul o_proj / "
                         f"down_proj) runs with tp = 1 only, got tp={tp}; build it with "
                         f"row_chunks a multiple of {tp}")
      o_chunks, down_chunks = model.row_parallel_chunks
      if o_chunks % tp or down_chunks % tp:
        raise ValueError(f"shard: tp={tp} must divide the model's row-parallel K chunks "
                         f"(o_proj {o_chunks}, down_proj {down_chunks}; row_chunks="
                         f"{model.row_chunks})")
    if parallelism.tp is not None and model.implementation == "xla":
      raise ValueError("shard: implementation='xla' (the stock path) has no vocab-parallel "
                       "head; shard it with tp=None, or use merge='psum' on a kernel model "
                       "for the Megatron control")
    v = cfg.vocab_size
    v_p = padded_vocab_size(v, tp)
    v_s = v_p // tp
    if tp > 1 and (tp - 1) * v_s >= v:
      raise ValueError(f"shard: vocab_size={v} is too small for tp={tp}: shards hold "
                       f"{v_s} (tile-aligned) rows each and the last would hold only padding")
    plan = _Plan(parallelism, merge, v, v_s)
    graphdef, state = nnx.split(model)
    placed = []
    for path, var in nnx.to_flat_state(state):
      var = var.replace(var.get_value())  # a new variable: the caller's model is untouched
      value = _layout_param(path, var, plan)
      sharding = NamedSharding(parallelism.mesh, _param_spec(var))
      placed.append((path, var.replace(jax.device_put(value, sharding))))
    local = nnx.merge(graphdef, nnx.from_flat_state(placed))
    for _, sub in nnx.iter_graph(local):
      if isinstance(sub, RowParallelLinear):
        sub.axis_name = parallelism.tp
        sub.merge = merge
      if isinstance(sub, MoEMLP) and tp > 1:
        sub.expert_axis = parallelism.tp
    self.config = cfg
    self.parallelism = parallelism
    self.merge = merge
    self.plan = plan
    self.dtype = model.dtype
    self.decoder = local
    self.head = ShardedHead(local.head, plan)

  def unshard(self) -> DecoderLM:
    """The plain :class:`~jaxrl_kernels.models.DecoderLM` with this model's current
    parameters (e.g. after training, for ``save_pretrained``): the vocabulary padding
    dropped, the sharding metadata removed, the arrays as they are placed."""
    graphdef, state = nnx.split(self.decoder)
    flat = []
    for path, var in nnx.to_flat_state(state):
      meta = dict(var.get_metadata())
      value = var.get_value()
      dim = meta.get("tp_dim")
      if dim is not None and meta["logical_axes"][dim] == "vocab":
        value = lax.slice_in_dim(value, 0, self.config.vocab_size, axis=dim)
      for key in ("tp_dim", "tp_axis", "fsdp_dim", "fsdp_axis"):
        meta.pop(key, None)
      flat.append((path, type(var)(value, **{k: v for k, v in meta.items()
                                             if k == "logical_axes"})))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    for _, sub in nnx.iter_graph(model):
      if isinstance(sub, RowParallelLinear):
        sub.axis_name, sub.merge = None, "canonical"
    return model

  # --------------------------------------------------------------------------- running

  def _run(self, call, arrays: tuple, specs: tuple, out_specs):
    return _sharded_call(self.decoder, _local_model, self.plan, call, arrays, specs,
                         out_specs)

  def _tokens(self, tokens, **others):
    tokens = check_token_ids(_OP, "tokens", tokens, self.decoder.config.vocab_size)
    if tokens.ndim != 2:
      raise ValueError(f"{_OP}: tokens must be [B, T], got shape {tokens.shape}")
    _check_batch(self.plan, tokens.shape[0], "tokens")
    out = {}
    for name, x in others.items():
      if x is not None:
        x = jnp.asarray(x)
        if x.shape != tokens.shape:
          raise ValueError(f"{_OP}: {name} must have shape {tokens.shape}, got {x.shape}")
      out[name] = x
    return tokens, out

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, *, max_docs: int | None = None
               ) -> jax.Array:
    """Final-norm hidden states ``[B, T, H]``, bitwise ``DecoderLM.__call__``'s.
    ``max_docs`` bounds the documents of each device's rows (default: its rows)."""
    tokens, o = self._tokens(tokens, positions=positions, segment_ids=segment_ids)
    spec = self.plan.batch_spec(2)
    return self._run(lambda m, t, p, s: m(t, p, s, max_docs=max_docs),
                     (tokens, o["positions"], o["segment_ids"]), (spec,) * 3,
                     self.plan.batch_spec(3))

  def logp(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None, *,
           positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
           max_docs: int | None = None, temperature: float = 1.0,
           return_entropy: bool = False):
    """float32 ``[B, T]`` log-probs (and entropy), bitwise ``DecoderLM.logp``'s."""
    tokens, o = self._tokens(tokens, targets=targets, mask=mask, positions=positions,
                             segment_ids=segment_ids)
    spec = self.plan.batch_spec(2)
    out = (spec, spec) if return_entropy else spec
    t_arr, t_static = _temperature(temperature)
    arrays = (tokens, o["targets"], o["mask"], o["positions"], o["segment_ids"], t_arr)
    specs = (spec,) * 5 + (PartitionSpec(),)

    def call(m, tok, tgt, mask, pos, seg, temp):
      return m.logp(tok, tgt, mask, positions=pos, segment_ids=seg, max_docs=max_docs,
                    temperature=t_static if temp is None else temp,
                    return_entropy=return_entropy)

    return self._run(call, arrays, specs, out)

  def policy_loss(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
                  *, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                  max_docs: int | None = None, temperature: float = 1.0, old_logp=None,
                  advantages=None, ref_logp=None, **objective):
    """``DecoderLM.policy_loss`` (the policy loss fused into the head) on every device's rows,
    the token counts global over ``(dp, fsdp)``: the unsharded model's loss and metrics
    (``metrics["logp"]`` bitwise), gradients with fsdp and dp as :meth:`logp`'s (tp > 1:
    forward only, its head the vocab-parallel fused loss).
    ``advantages`` is ``[B]`` or ``[B, T]``; the other objective arguments are those of
    :func:`jaxrl_kernels.rl.linear_policy_loss` (not ``axis_names``: the batch axes are
    this model's)."""
    name = f"{_OP}.policy_loss"
    if "axis_names" in objective:
      raise ValueError(f"{name}: axis_names is set by the sharded model (its batch axes "
                       f"{self.plan.par.batch_axes}); leave it out")
    if old_logp is None or advantages is None:
      raise TypeError(f"{name}: old_logp and advantages are required")
    tokens, o = self._tokens(tokens, targets=targets, mask=mask, positions=positions,
                             segment_ids=segment_ids, old_logp=old_logp, ref_logp=ref_logp)
    advantages = jnp.asarray(advantages)
    if advantages.shape not in (tokens.shape[:1], tokens.shape):
      raise ValueError(f"{name}: advantages must be [B] or [B, T] = {tokens.shape}, got "
                       f"{advantages.shape}")
    spec = self.plan.batch_spec(2)
    t_arr, t_static = _temperature(temperature)
    arrays = (tokens, o["targets"], o["mask"], o["positions"], o["segment_ids"], t_arr,
              o["old_logp"], advantages, o["ref_logp"])
    specs = ((spec,) * 5 + (PartitionSpec(),)
             + (spec, self.plan.batch_spec(advantages.ndim), spec))
    axes = self.plan.par.batch_axes

    def call(m, tok, tgt, mask, pos, seg, temp, old, adv, ref):
      loss, metrics = m.policy_loss(
          tok, tgt, mask, positions=pos, segment_ids=seg, max_docs=max_docs,
          temperature=t_static if temp is None else temp, old_logp=old, advantages=adv,
          ref_logp=ref, axis_names=axes, **objective)
      per_token = {k: metrics.pop(k) for k in ("logp", "entropy")}
      return loss, metrics, per_token  # loss and metrics global over the batch axes

    loss, metrics, per_token = self._run(call, arrays, specs,
                                         (PartitionSpec(), PartitionSpec(), spec))
    return loss, {**metrics, **per_token}

  def logits(self, tokens: jax.Array, *, positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None, max_docs: int | None = None,
             temperature: float = 1.0) -> jax.Array:
    """float32 logits ``[B, T, V]`` (for checks), bitwise ``DecoderLM.logits``'."""
    h = self(tokens, positions, segment_ids, max_docs=max_docs)
    return self.head.logits(h, temperature=temperature)

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    """An empty cache, its keys and values ``[batch, max_len, Hkv, head_dim]`` split over
    ``(dp, fsdp)`` (rows) and tp (kv heads)."""
    _check_batch(self.plan, batch, "the cache")
    cfg = self.config
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    zeros = tuple(_place(jnp.zeros(shape, self.dtype), self.plan, self.plan.cache_spec)
                  for _ in range(cfg.num_hidden_layers))
    lengths = _place(jnp.zeros((batch,), jnp.int32), self.plan, self.plan.batch_spec(1))
    return KVCache(zeros, zeros, lengths)

  def _cache_specs(self) -> KVCache:
    n = self.config.num_hidden_layers
    kv = (self.plan.cache_spec,) * n
    return KVCache(kv, kv, self.plan.batch_spec(1))

  def prefill(self, tokens: jax.Array, lengths: jax.Array, cache: KVCache
              ) -> tuple[jax.Array, KVCache]:
    """``DecoderLM.prefill`` on every device's rows and kv heads: ``(hidden [B, H], cache)``."""
    tokens, lengths = check_prefill(f"{_OP}.prefill", tokens, lengths, cache,
                                    self.decoder.config.vocab_size)
    _check_batch(self.plan, tokens.shape[0], "tokens")
    return self._run(lambda m, t, n, c: m.prefill(t, n, c), (tokens, lengths, cache),
                     (self.plan.batch_spec(2), self.plan.batch_spec(1), self._cache_specs()),
                     (self.plan.batch_spec(2), self._cache_specs()))

  def decode_step(self, token: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """``DecoderLM.decode_step`` on every device's rows and kv heads."""
    token = check_decode_token(f"{_OP}.decode_step", token, cache,
                               self.decoder.config.vocab_size)
    return self._run(lambda m, t, c: m.decode_step(t, c), (token, cache),
                     (self.plan.batch_spec(1), self._cache_specs()),
                     (self.plan.batch_spec(2), self._cache_specs()))


def shard(model: DecoderLM, parallelism: Parallelism, *, merge: str = "canonical"
          ) -> ShardedDecoderLM:
  """``model`` with its parameters placed on ``parallelism.mesh``, run sharded.

  Per-token outputs are bitwise the unsharded model's at every (tp, fsdp, dp) layout
  (``merge="canonical"``). Refused with a ``ValueError`` naming the argument: a model that
  is not a ``DecoderLM``; tp not dividing ``num_key_value_heads`` or the model's
  ``row_chunks``; ``row_chunks=1`` with tp > 1; a vocabulary too small for tp (a shard of
  padding only); the stock ``implementation="xla"`` with a tp axis. ``Parallelism`` refuses
  axis names not in the mesh, an axis named twice and a mesh axis without a role.

  Args:
    model: the :class:`~jaxrl_kernels.models.DecoderLM` (left unchanged; its parameters are
      copied onto the mesh).
    parallelism: the axes' roles.
    merge: ``"canonical"`` or ``"psum"`` (the control; see :class:`ShardedDecoderLM`).
  """
  return ShardedDecoderLM(model, parallelism, merge=merge)
