"""Vocab-parallel (tensor-parallel) ``linear_logp`` under ``shard_map``.

Rollout engines shard the LM head over the vocabulary (TP = 8 sampling) while
trainers often do not (FSDP, TP = 1). The log-probs must not care. Here they
do not, bit for bit:

* the vocabulary is cut into the same global ``VOCAB_TILE``-wide tiles as the
  unsharded op, and each device reduces the tiles it holds to float32
  partials ``(m, s, u)`` with the very kernel ``linear_logp`` uses;
* the partials of all devices are gathered over ``axis_name`` and every
  device folds *all* tiles in ascending global order with the same merge
  kernel: the fold is the unsharded one, term for term;
* the target logit comes from the shard that owns the target through a sum in
  which exactly one term is non-zero (exact).

So ``logp`` and ``entropy`` equal the unsharded ``linear_logp`` bit for bit for
any TP degree whose shard boundaries fall on the tile grid. ``merge="psum"``
is the usual alternative (merge locally, then ``pmax``/``psum`` two floats per
token): cheaper to communicate, but its rounding depends on the TP degree; it
exists as the control and for benchmarks.

Layout: device ``r`` of the ``n`` along ``axis_name`` holds the contiguous
global vocab ids ``[r V_s, (r + 1) V_s)``, ``V_s`` its weight's vocab extent.
``n V_s >= vocab_size``; columns ``>= vocab_size`` are padding and are masked
to -inf inside the kernel (their values are never read). With ``n > 1``,
``V_s`` must be a multiple of ``VOCAB_TILE``: :func:`padded_vocab_size` says
what to pad to and :func:`pad_vocab` pads a weight.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_kernels import _compat, _validation
from jaxrl_kernels.linear_logp import api
from jaxrl_kernels.linear_logp.config import BackwardConfig
from jaxrl_kernels.pallas import softmax_partials as sp

VOCAB_TILE = api.VOCAB_TILE
MERGES = ("all_gather", "psum")


def padded_vocab_size(vocab_size: int, tp: int) -> int:
  """The smallest ``tp * V_s >= vocab_size`` with ``V_s`` a multiple of ``VOCAB_TILE``
  (``vocab_size`` itself when ``tp == 1``)."""
  if tp < 1 or vocab_size < 1:
    raise ValueError(f"padded_vocab_size: need vocab_size >= 1 and tp >= 1, got {vocab_size}, "
                     f"{tp}")
  if tp == 1:
    return vocab_size
  return tp * (-(-vocab_size // (tp * VOCAB_TILE)) * VOCAB_TILE)


def pad_vocab(weight: jax.Array, tp: int, *, weight_layout: str = "hv",
              bias: jax.Array | None = None):
  """Pads ``weight`` (and ``bias``) with zero vocab columns to
  :func:`padded_vocab_size`, so it splits into ``tp`` tile-aligned shards.
  Returns the weight, or ``(weight, bias)`` when a bias is given."""
  _validation.check_choice("pad_vocab", "weight_layout", weight_layout, api.LAYOUTS)
  tp = _validation.check_int("pad_vocab", "tp", tp, minimum=1)
  weight = jnp.asarray(weight)
  if weight.ndim != 2:
    raise ValueError(f"pad_vocab: weight must be 2-D, got shape {weight.shape}")
  axis = 1 if weight_layout == "hv" else 0
  v = weight.shape[axis]
  extra = padded_vocab_size(v, tp) - v
  widths = [(0, 0), (0, 0)]
  widths[axis] = (0, extra)
  w = jnp.pad(weight, widths)
  if bias is None:
    return w
  return w, jnp.pad(bias, (0, extra))


def _axis_size(axis_name) -> int:
  if hasattr(lax, "axis_size"):
    return int(lax.axis_size(axis_name))
  return int(lax.psum(1, axis_name))  # pragma: no cover - older jax


@dataclasses.dataclass(frozen=True)
class _Static:
  layout: str
  compute_dtype: str
  implementation: str
  vocab_size: int
  axis_name: object
  tp: int
  local_vocab: int
  merge: str
  config: BackwardConfig | None
  check_vma: bool
  entropy: bool  # the caller returns the entropy (else its terms may be left out)

  @property
  def n_global_tiles(self) -> int:
    return -(-self.vocab_size // VOCAB_TILE)

  def valid_table(self) -> tuple[tuple[int, ...], np.ndarray]:
    """Distinct per-rank valid column counts and, per rank, its index among them."""
    valid = [min(max(self.vocab_size - r * self.local_vocab, 0), self.local_vocab)
             for r in range(self.tp)]
    values = tuple(sorted(set(valid)))
    return values, np.asarray([values.index(x) for x in valid], np.int32)


def _per_valid(st: _Static, fn):
  """Calls ``fn(valid_vocab)`` with this device's static count of real columns.

  The count is a kernel constant but depends on the rank: one branch per
  distinct value (at most three: full, partial, empty), picked by rank.
  """
  values, index = st.valid_table()
  if len(values) == 1:
    return fn(values[0])
  branch = jnp.asarray(index)[lax.axis_index(st.axis_name)]
  return lax.switch(branch, [functools.partial(fn, v) for v in values])


def _varying_axes(x) -> frozenset:
  """The mesh axes ``x`` is typed as varying over (empty unless ``check_vma``)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def _gather_invariant(x, st: _Static, fill: float, reduce):
  """``all_gather(x, tiled=True)`` typed invariant over the TP axis (what a typed
  ``shard_map`` needs for a replicated result): each device places its tiles in a
  buffer of ``fill`` and a ``pmax`` (m, fill -inf) or ``psum`` (s and u, which are
  never -0; fill +0) combines them: exact, one real term per element."""
  n_local = x.shape[0]
  buf = jnp.full((st.tp * n_local, *x.shape[1:]), fill, x.dtype)
  rank = lax.axis_index(st.axis_name)
  return reduce(lax.dynamic_update_slice_in_dim(buf, x, rank * n_local, axis=0), st.axis_name)


def _psum_merge(m, s, u, st: _Static, rank):
  """The TP-degree-dependent merge: local fold, then a ``pmax`` and two ``psum``
  of one float per token. Not bitwise TP-invariant (the control)."""
  n_local = m.shape[0]
  tile = rank * n_local + jnp.arange(n_local)[:, None]
  real = tile < st.n_global_tiles  # padding-only tiles are made empty (exact)
  m = jnp.where(real, m, -jnp.inf)
  s = jnp.where(real, s, 0.0)
  u = jnp.where(real, u, 0.0)
  lse_l, _, ent_l = api.backend(st.implementation).merge_partials(m, s, u)
  has = s.sum(axis=0) > 0
  lse_l = jnp.where(has, lse_l, -jnp.inf)
  big = lax.pmax(lse_l, st.axis_name)
  lse = big + jnp.log(lax.psum(jnp.where(has, jnp.exp(lse_l - big), 0.0), st.axis_name))
  # H = sum_r pi_r (H_r + lse - lse_r), pi_r = e^(lse_r - lse): no cancellation.
  pi = jnp.where(has, jnp.exp(lse_l - lse), 0.0)
  ent = lax.psum(jnp.where(has, pi * (ent_l + (lse - lse_l)), 0.0), st.axis_name)
  return lse, lse - ent, ent


def _forward(hidden, weight, bias, temp, targets, mask, st: _Static):
  be = api.backend(st.implementation)
  rank = lax.axis_index(st.axis_name)
  local_t = targets - rank * st.local_vocab
  t_arg = 1.0 if temp is None else temp
  m, s, u, tz = _per_valid(st, lambda valid: be.tile_partials(
      hidden, weight, bias, local_t, layout=st.layout, temperature=t_arg,
      compute_dtype=st.compute_dtype, vocab_offset=0, valid_vocab=valid, entropy=st.entropy))
  if st.merge == "all_gather":
    # Tiles past the vocabulary (padding) sit at the end of the global order: dropped.
    n = st.n_global_tiles
    if st.check_vma:
      m, s, u = (_gather_invariant(x, st, f, r)[:n]
                 for x, f, r in ((m, -jnp.inf, lax.pmax), (s, 0.0, lax.psum), (u, 0.0, lax.psum)))
    else:
      m, s, u = (lax.all_gather(x, st.axis_name, axis=0, tiled=True)[:n] for x in (m, s, u))
    lse, mean_z, ent = be.merge_partials(m, s, u)
  else:
    lse, mean_z, ent = _psum_merge(m, s, u, st, rank)
  tz = lax.psum(tz, st.axis_name)  # one owner per row: exact
  logp, ent = sp.finalize(tz, lse, ent, targets, mask, st.vocab_size)
  return (logp, ent), (lse, mean_z, local_t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fused(hidden, weight, bias, temp, targets, mask, st):
  return _forward(hidden, weight, bias, temp, targets, mask, st)[0]


def _fused_fwd(hidden, weight, bias, temp, targets, mask, st):
  out, (lse, mean_z, local_t) = _forward(hidden, weight, bias, temp, targets, mask, st)
  return out, (hidden, weight, bias, temp, targets, local_t, mask, lse, mean_z)


def _fused_bwd(st, res, cts):
  hidden, weight, bias, temp, targets, local_t, mask, lse, mean_z = res
  if st.check_vma:
    # Typed shard_map: a replicated output's cotangent arrives whole, and JAX
    # sums the per-shard dH of the replicated hidden (a varying cotangent).
    cts = tuple(jnp.asarray(c, jnp.float32) for c in cts)
  else:
    # shard_map(check_vma=False) hands each device 1/tp of a replicated output's
    # cotangent and sums a replicated input's cotangents over devices: the sum
    # restores the full cotangent (what the transpose of the all_gather would
    # do), and dH is left per shard for shard_map to sum.
    cts = tuple(lax.psum(jnp.asarray(c, jnp.float32), st.axis_name) for c in cts)
  g_logp, g_ent = api.masked_cotangents(cts, targets, mask, st.vocab_size)

  def local(valid):
    return api.backend(st.implementation).backward(
        hidden, weight, bias, local_t, lse, mean_z, g_logp, g_ent, layout=st.layout,
        temperature=1.0 if temp is None else temp, compute_dtype=st.compute_dtype,
        vocab_offset=0, valid_vocab=valid, config=st.config, entropy=st.entropy)

  dh, dw, db = _per_valid(st, local)
  db = None if bias is None else db.astype(bias.dtype)
  return dh.astype(hidden.dtype), dw.astype(weight.dtype), db, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def _tp_checksum(x: jax.Array) -> jax.Array:
  """Per-row int32 checksums of ``x``'s bits (two independent weightings), for
  comparing rows across devices without moving them."""
  x = x.reshape(x.shape[0], -1) if x.ndim > 1 else x[:, None]
  if jnp.issubdtype(x.dtype, jnp.floating):
    width = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[jnp.dtype(x.dtype).itemsize]
    x = lax.bitcast_convert_type(x, width)
  bits = x.astype(jnp.int32)
  w = jnp.arange(1, bits.shape[1] + 1, dtype=jnp.int32)
  return jnp.stack([jnp.sum(bits, axis=1), jnp.sum(bits * w, axis=1)], axis=1)


def _check_same_across(axis_name, **arrays) -> None:
  """``checkify.check`` that every array is the same on every device of ``axis_name``."""
  for name, x in arrays.items():
    if x is None:
      continue
    c = _tp_checksum(x)
    same = jnp.all(lax.pmax(c, axis_name) == lax.pmin(c, axis_name))
    checkify.check(same, f"vocab_parallel_linear_logp: {name} differs across the devices of "
                         f"axis {axis_name!r}; it must be the same on each (validate=True)")


def vocab_parallel_linear_logp(hidden: jax.Array, weight_shard: jax.Array, targets: jax.Array,
                               *, axis_name, vocab_size: int, mask: jax.Array | None = None,
                               bias_shard: jax.Array | None = None,
                               temperature: float | jax.Array = 1.0,
                               return_entropy: bool = False, weight_layout: str = "hv",
                               fp32_head: bool = False, merge: str = "all_gather",
                               implementation: str | None = None,
                               config: BackwardConfig | None = None, validate: bool = False):
  """``linear_logp`` with the LM head's vocabulary sharded over ``axis_name``.

  Call it inside ``shard_map`` (``jaxrl_kernels._compat.shard_map`` picks
  ``jax.shard_map`` or the experimental one): with ``check_vma=False``, or
  with JAX's default ``check_vma=True`` for ``implementation="cpu"`` (the
  Pallas kernels do not declare how their outputs vary over mesh axes).
  :func:`vocab_parallel_logp` does the ``shard_map`` for you. ``hidden``,
  ``targets`` and ``mask`` must be the same on every device along
  ``axis_name`` (they may be split over other mesh axes, e.g. data).
  Nothing checks that unless ``validate=True``: with rows that differ across
  the devices, each device reduces its own rows against its vocabulary shard
  and the merged results are finite and wrong.

  Args:
    hidden: ``[..., H]`` float.
    weight_shard: this device's ``[H, V_s]`` (``"hv"``) or ``[V_s, H]``
      (``"vh"``) slice: global vocab ids ``[r V_s, (r + 1) V_s)`` on rank ``r``.
    targets: ``[...]`` int *global* ids; active ids outside
      ``[0, vocab_size)`` give NaN.
    axis_name: the mesh axis the vocabulary is split over.
    vocab_size: the real (unpadded) vocabulary size ``V``.
    mask, bias_shard, temperature, return_entropy, weight_layout, fp32_head,
      implementation, config: as in :func:`jaxrl_kernels.linear_logp`
      (``bias_shard`` is this device's ``[V_s]`` slice of the bias; a traced
      temperature must be the same on every device). ``"xla"`` is not offered:
      the materialised path has no TP form. ``"mosaic"`` (Hopper, bf16/fp16,
      the default there) is TP-bitwise like the others: its tiles' bits do not
      depend on the shard that holds them; compare against the unsharded op
      with the same implementation.
    merge: ``"all_gather"`` (default): bitwise equal to the unsharded
      ``linear_logp`` for every TP degree. ``"psum"``: the per-shard merge
      (two floats per token on the wire); its bits depend on the TP degree.
    validate: check (``jax.experimental.checkify.check``, so run the function
      under ``checkify.checkify``) that ``hidden``, ``targets`` and ``mask``
      are the same on every device of ``axis_name``: per-row checksums of
      their bits, compared with a ``pmax`` and a ``pmin`` (``[T, 2]`` int32
      each).

  Returns:
    float32 ``logp`` (and ``entropy``) of shape ``targets.shape``, the same on
    every device of ``axis_name``.

  Gradients: differentiate *outside* the ``shard_map`` (as
  :func:`vocab_parallel_logp` and ``jax.grad`` of a jitted step do). dW (and
  db) stay local to each shard; dH is each shard's term, summed over
  ``axis_name`` by JAX: a sum over shards, within CONTRACT section 2 of the
  unsharded gradient, not TP-bitwise. Forward-mode
  autodiff is not supported (a ``custom_vjp``).
  """
  prepared = prepare("vocab_parallel_linear_logp", hidden, weight_shard, targets,
                     axis_name=axis_name, vocab_size=vocab_size, mask=mask,
                     bias_shard=bias_shard, temperature=temperature,
                     return_entropy=return_entropy, weight_layout=weight_layout,
                     fp32_head=fp32_head, merge=merge, implementation=implementation,
                     config=config, validate=validate)
  if prepared.args is None:
    logp = ent = jnp.zeros(prepared.lead, jnp.float32)
    return (logp, ent) if return_entropy else logp
  logp, ent = _fused(*prepared.args, prepared.static)
  logp, ent = logp.reshape(prepared.lead), ent.reshape(prepared.lead)
  return (logp, ent) if return_entropy else logp


class Prepared(NamedTuple):
  """A validated call: the kernel statics, the ``[T]``-row arguments of the fused op
  (``hidden, weight, bias, temperature, targets, mask``; None when there are no tokens)
  and the token shape."""

  static: _Static
  args: tuple | None
  lead: tuple[int, ...]


def prepare(op: str, hidden, weight_shard, targets, *, axis_name, vocab_size: int, mask,
            bias_shard, temperature, return_entropy: bool, weight_layout: str,
            fp32_head: bool, merge: str, implementation, config, validate: bool) -> Prepared:
  """The checks and the row layout of :func:`vocab_parallel_linear_logp` (``op`` names the
  caller in errors), shared with the vocab-parallel fused objective."""
  _validation.check_choice(op, "merge", merge, MERGES)
  _validation.check_choice(op, "weight_layout", weight_layout, api.LAYOUTS)
  _validation.check_bool(op, "validate", validate)
  weight_shard = jnp.asarray(weight_shard)
  if weight_shard.ndim != 2:
    raise ValueError(f"{op}: weight_shard must be 2-D, got shape {weight_shard.shape}")
  tp = _axis_size(axis_name)
  v_s = weight_shard.shape[1] if weight_layout == "hv" else weight_shard.shape[0]
  vocab_size = _validation.check_int(op, "vocab_size", vocab_size, minimum=1)
  if tp * v_s < vocab_size:
    raise ValueError(f"{op}: {tp} shards of {v_s} vocab columns cover {tp * v_s} ids < "
                     f"vocab_size={vocab_size}")
  if tp > 1 and v_s % VOCAB_TILE:
    raise ValueError(
        f"{op}: shard boundaries must fall on the {VOCAB_TILE}-wide vocab tile grid, but each "
        f"of the {tp} shards along {axis_name!r} holds {v_s} columns; pad the vocabulary to "
        f"{padded_vocab_size(vocab_size, tp)} columns "
        f"({padded_vocab_size(vocab_size, tp) // tp} per shard; see pad_vocab)")
  x = api.validate(op, hidden, weight_shard, targets, bias=bias_shard, mask=mask,
                   temperature=temperature, weight_layout=weight_layout, fp32_head=fp32_head,
                   return_entropy=return_entropy)
  if config is not None and not isinstance(config, BackwardConfig):
    raise TypeError(f"{op}: config must be a BackwardConfig or None, got {config!r}")
  impl = api.resolve(op, implementation, x.compute_dtype,
                     supported=api.PARTIAL_IMPLEMENTATIONS)
  check_vma = bool(_varying_axes(weight_shard))
  if check_vma and impl != "cpu":
    raise ValueError(
        f"{op}: implementation={impl!r} runs inside shard_map(..., check_vma=False) only: its "
        f"Pallas kernels do not declare how their outputs vary over mesh axes, which "
        f"check_vma=True requires (weight_shard is typed varying over "
        f"{sorted(_varying_axes(weight_shard))}); implementation='cpu' runs under both")
  lead = x.targets.shape
  t = math.prod(lead)
  if t == 0:
    return Prepared(None, None, lead)
  h2 = x.hidden.reshape(t, x.hidden.shape[-1])
  t2 = x.targets.reshape(t)
  m2 = None if x.mask is None else x.mask.reshape(t)
  if validate:
    _check_same_across(axis_name, hidden=h2, targets=t2, mask=m2)
  h2, w = api.with_features(api.zero_masked_rows(h2, m2), x.weight, weight_layout)
  st = _Static(weight_layout, x.compute_dtype.name, impl, vocab_size, axis_name, tp, v_s, merge,
               config, check_vma, bool(return_entropy))
  return Prepared(st, (h2, w, x.bias, sp.temperature_scalar(x.temperature), t2, m2), lead)


def _weight_axis(weight_spec, layout: str, mesh: Mesh):
  """The mesh axis that ``weight_spec`` splits the vocab dimension over (and only it)."""
  spec = tuple(weight_spec) + (None,) * (2 - len(tuple(weight_spec)))
  v_dim, h_dim = (1, 0) if layout == "hv" else (0, 1)
  axis_name = spec[v_dim]
  if axis_name is None or spec[h_dim] is not None:
    raise ValueError(f"vocab_parallel_logp: weight_spec must split the vocab dimension (dim "
                     f"{v_dim} for {layout!r}) and only it, got {weight_spec}")
  if isinstance(axis_name, tuple):
    if len(axis_name) != 1:
      raise ValueError(f"vocab_parallel_logp: the vocab dimension must be split over one mesh "
                       f"axis, got {axis_name}")
    axis_name = axis_name[0]
  if axis_name not in mesh.axis_names:
    raise ValueError(f"vocab_parallel_logp: weight_spec names axis {axis_name!r}, not in the "
                     f"mesh axes {mesh.axis_names}")
  return spec, v_dim, axis_name


def _placed(x, mesh: Mesh, spec: PartitionSpec):
  """``x`` laid out as ``spec`` on ``mesh``: ``device_put`` for concrete arrays (a
  no-op when already so), ``reshard`` for traced ones when the mesh has Explicit
  axes (``jax.make_mesh``'s default); on Auto axes ``shard_map`` reshards them."""
  sharding = NamedSharding(mesh, spec)
  if isinstance(x, jax.core.Tracer):
    explicit = jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ()))
    return jax.sharding.reshard(x, sharding) if explicit else x
  if getattr(x, "sharding", None) == sharding:
    return x
  return jax.device_put(x, sharding)


def vocab_parallel_logp(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *,
                        mesh: Mesh, weight_spec: PartitionSpec, vocab_size: int | None = None,
                        token_spec: PartitionSpec | None = None,
                        mask: jax.Array | None = None, bias: jax.Array | None = None,
                        **kwargs):
  """Runs :func:`vocab_parallel_linear_logp` under ``shard_map`` on ``mesh``.

  Takes global arrays, sharded or not, on any mesh (``jax.make_mesh``'s
  Explicit axes, Auto axes, or a ``Mesh(...)``): they are resharded to the
  layout below as needed.

  Args:
    hidden: ``[T, H]`` (global view).
    weight: the global ``[H, V_p]`` / ``[V_p, H]`` weight, ``V_p`` a tile-aligned
      padding of the vocabulary (see :func:`pad_vocab`).
    targets, mask: ``[T]``.
    mesh: the device mesh.
    weight_spec: the weight's ``PartitionSpec``; its vocab dimension names the
      TP axis, e.g. ``P(None, "tp")`` for ``"hv"``, ``P("tp", None)`` for
      ``"vh"``; the hidden dimension must not be split.
    vocab_size: the real vocabulary size (default: the weight's vocab extent).
    token_spec: how the tokens are split over the other mesh axes, e.g.
      ``P("data")`` (default: replicated).
    bias: ``[V_p]`` or None (split like the weight's vocab dimension).
    **kwargs: the remaining keywords of :func:`vocab_parallel_linear_logp`.

  Returns:
    float32 ``logp`` ``[T]`` (and entropy), split like ``token_spec``.
  """
  op = "vocab_parallel_logp"
  layout = kwargs.get("weight_layout", "hv")
  _validation.check_choice(op, "weight_layout", layout, api.LAYOUTS)
  weight = jnp.asarray(weight) if not isinstance(weight, jax.Array) else weight
  if weight.ndim != 2:
    raise ValueError(f"{op}: weight must be 2-D, got shape {weight.shape}")
  spec, v_dim, axis_name = _weight_axis(weight_spec, layout, mesh)
  v_p = weight.shape[v_dim]
  vocab_size = v_p if vocab_size is None else _validation.check_int(op, "vocab_size",
                                                                    vocab_size, minimum=1)
  tp = mesh.shape[axis_name]
  if v_p % tp:
    raise ValueError(f"{op}: the weight's {v_p} vocab columns do not split evenly over {tp} "
                     f"devices of {axis_name!r}; pad to {padded_vocab_size(vocab_size, tp)} "
                     f"(see pad_vocab)")
  targets = _validation.as_ids(op, "targets", targets)
  mask = _validation.as_mask(op, "mask", mask, targets.shape)
  if _validation.is_concrete(targets, mask):
    _validation.check_ids_in_range(op, "targets", targets, vocab_size, mask)
  tok = PartitionSpec() if token_spec is None else token_spec
  tok_axes = {a for part in tuple(tok) if part is not None
              for a in (part if isinstance(part, tuple) else (part,))}
  if axis_name in tok_axes:
    raise ValueError(f"{op}: token_spec {tok} must not split the tokens over the TP axis "
                     f"{axis_name!r}")
  hid_spec = PartitionSpec(*(tuple(tok) + (None,)))
  b_spec = PartitionSpec(axis_name)
  ret_ent = kwargs.get("return_entropy", False)

  def body(h, w, t, mk, b):
    return vocab_parallel_linear_logp(h, w, t, axis_name=axis_name, vocab_size=vocab_size,
                                      mask=mk, bias_shard=b, **kwargs)

  out_specs = (tok, tok) if ret_ent else tok
  args = (hidden, weight, targets, mask, bias)
  specs = (hid_spec, PartitionSpec(*spec), tok, None if mask is None else tok,
           None if bias is None else b_spec)
  live = [i for i, a in enumerate(args) if a is not None]

  def wrapped(*xs):
    full = [None] * len(args)
    for i, x in zip(live, xs):
      full[i] = x
    return body(*full)

  fn = _compat.shard_map(wrapped, mesh=mesh, in_specs=tuple(specs[i] for i in live),
                         out_specs=out_specs, check_vma=False)
  placed = [_placed(jnp.asarray(args[i]), mesh, specs[i]) for i in live]
  return fn(*placed)
