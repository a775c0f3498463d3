"""Fused LM-head backward in Pallas: logits recomputed tile by tile, never stored whole.

With ``z = (h W + b) / temperature``, ``p = softmax(z)`` and the O(T) residuals
``lse`` and ``mean_z = sum p z`` from the forward, the logit cotangent is

    dz = (g_logp (onehot(t) - p) - g_ent p (z - mean_z)) / temperature.

The vocabulary is walked in chunks of ``chunk`` columns (a ``lax.fori_loop``,
so one chunk buffer is live at a time); per chunk, three kernels:

1. ``_dlogits_kernel`` (grid: token blocks x vocab tiles of the chunk):
   recomputes the logits tile with :func:`linear_logp_fwd.logits_tile` (the
   forward's own code) and writes ``dz`` for the chunk, ``[T, chunk]``.
2. ``_dhidden_kernel`` (grid: token blocks x H blocks): ``dH += dz W_chunk^T``
   into a float32 accumulator, ascending over the chunk's columns; chunks come
   in ascending order, so each dH row is one fixed sequence of float32 adds
   over the vocabulary: batch-invariant.
3. ``_dweight_kernel`` (grid: H blocks x vocab blocks of the chunk): ``dW_chunk
   = h^T dz`` (and ``db = sum_t dz``), ascending over token blocks:
   deterministic run to run (it depends on the batch by its nature).

Memory: ``[T, chunk]`` for ``dz`` plus a float32 ``[T, H]`` accumulator; no
``[T, V]`` array.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_kernels.pallas import _common
from jaxrl_kernels.pallas import linear_logp_fwd as fwd
from jaxrl_kernels.pallas import softmax_partials as sp

VOCAB_TILE = fwd.VOCAB_TILE


@dataclasses.dataclass(frozen=True)
class Config:
  """Free tiling knobs of the fused backward (the defaults never depend on T;
  the logits recomputation's H step is the forward's contract ``block_h``).

  Attributes:
    chunk: vocab columns per step of the chunk loop (a multiple of VOCAB_TILE);
      bounds the ``[T, chunk]`` cotangent buffer.
    logits: tiles of the logits recomputation (same meaning as the forward's).
    dh_block_t, dh_block_h, dh_block_v: dH tiles (token rows, H columns, and
      the vocab step of its reduction).
    dw_block_h, dw_block_v, dw_block_t: dW tiles (H rows, vocab columns, and
      the token step of its reduction).
  """

  chunk: int = 4096
  logits: fwd.Config = fwd.Config()  # noqa: RUF009 - frozen, shared safely
  dh_block_t: int = 128
  dh_block_h: int = 128
  dh_block_v: int = 64
  dw_block_h: int = 128
  dw_block_v: int = 128
  dw_block_t: int = 64
  num_warps: int = 8
  num_stages: int = 3


def default_config(compute_dtype, interpret: bool) -> Config:
  logits = fwd.default_config(compute_dtype, interpret)
  if interpret:
    return Config(chunk=512, logits=logits, dh_block_t=32, dh_block_h=64, dh_block_v=128,
                     dw_block_h=64, dw_block_v=128, dw_block_t=32)
  if jnp.dtype(compute_dtype) == jnp.float32:
    return Config(chunk=4096, logits=logits, dh_block_t=64, dh_block_h=64, dh_block_v=32,
                     dw_block_h=64, dw_block_v=64, dw_block_t=32, num_warps=4, num_stages=3)
  return Config(chunk=4096, logits=logits)


def _params(cfg: Config, interpret: bool) -> dict:
  return _common.triton_compiler_params(cfg.num_warps, cfg.num_stages, interpret)


def _dlogits_kernel(off_ref, h_ref, w_ref, *refs, t, n_t, n_v, has_bias, has_temp, block_t,
                    group_t, vocab_offset, **tile_kw):
  b_ref, temperature, (tg_ref, lse_ref, mean_ref, gl_ref, ge_ref, dz_ref) = fwd.split_refs(
      refs, has_bias=has_bias, has_temp=has_temp)
  i, j = _common.group_swizzle(pl.program_id(0), n_t, n_v, group_t)
  row0 = i * block_t
  col0 = off_ref[0] + j * VOCAB_TILE
  z, rows, cols, row_ok, col_ok = fwd.logits_tile(
      h_ref, w_ref, b_ref, row0, col0, t=t, block_t=block_t, temperature=temperature, **tile_kw)
  rs = pl.ds(row0, block_t)
  lse = pltriton.load(lse_ref.at[rs], mask=row_ok, other=0)
  mean = pltriton.load(mean_ref.at[rs], mask=row_ok, other=0)
  gl = pltriton.load(gl_ref.at[rs], mask=row_ok, other=0)
  ge = pltriton.load(ge_ref.at[rs], mask=row_ok, other=0)
  tg = pltriton.load(tg_ref.at[rs], mask=row_ok, other=-1) - vocab_offset
  onehot = (cols[None, :] == tg[:, None]).astype(jnp.float32)
  dz = sp.logit_grad(z, lse[:, None], mean[:, None], onehot, gl[:, None], ge[:, None],
                     col_ok[None, :], temperature)
  dz = jnp.where(row_ok[:, None] & col_ok[None, :], dz, 0.0)
  # Columns past the vocabulary are written as zeros: the later kernels read
  # the whole chunk.
  pltriton.store(dz_ref.at[rs, pl.ds(j * VOCAB_TILE, VOCAB_TILE)], dz.astype(dz_ref.dtype),
                 mask=jnp.broadcast_to(row_ok[:, None], dz.shape))


def _dhidden_kernel(off_ref, dz_ref, w_ref, acc_in_ref, acc_ref, *, t, h, v, chunk, layout,
                    block_t, block_h, block_v, compute_dtype, precision):
  del acc_in_ref  # aliased with acc_ref
  row0 = pl.program_id(0) * block_t
  hc0 = pl.program_id(1) * block_h
  c0 = off_ref[0]
  row_ok = (row0 + lax.broadcasted_iota(jnp.int32, (block_t,), 0)) < t
  h_ok = (hc0 + lax.broadcasted_iota(jnp.int32, (block_h,), 0)) < h
  rs, hs = pl.ds(row0, block_t), pl.ds(hc0, block_h)

  def body(kk, acc):
    vs = c0 + kk * block_v + lax.broadcasted_iota(jnp.int32, (block_v,), 0)
    v_ok = vs < v
    g = pltriton.load(dz_ref.at[rs, pl.ds(kk * block_v, block_v)],
                      mask=jnp.broadcast_to(row_ok[:, None], (block_t, block_v)), other=0)
    if layout == "hv":  # W[h, v]: contract dz's vocab dim with W's second dim
      w = pltriton.load(w_ref.at[hs, pl.ds(c0 + kk * block_v, block_v)],
                        mask=h_ok[:, None] & v_ok[None, :], other=0)
      dims = ((1,), (1,))
    else:  # W[v, h]
      w = pltriton.load(w_ref.at[pl.ds(c0 + kk * block_v, block_v), hs],
                        mask=v_ok[:, None] & h_ok[None, :], other=0)
      dims = ((1,), (0,))
    return acc + lax.dot_general(g.astype(compute_dtype), w.astype(compute_dtype),
                                 (dims, ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)

  mask = row_ok[:, None] & h_ok[None, :]
  acc = pltriton.load(acc_ref.at[rs, hs], mask=mask, other=0)
  # Continues the float32 sum where the previous chunk stopped, ascending in V.
  acc = lax.fori_loop(0, chunk // block_v, body, acc)
  pltriton.store(acc_ref.at[rs, hs], acc, mask=mask)


def _dbias_kernel(off_ref, dz_ref, db_in_ref, db_ref, *, t, v, block_t, block_v):
  """``db[v] += sum_t dz[t, v]`` over ascending token blocks (run-to-run deterministic).

  Its own kernel: on Hopper (jax 0.11.2) folding this sum into the dW kernel
  as a second output corrupted dW (tests/linear_logp/test_linear_logp_gpu.py).
  """
  del db_in_ref  # aliased with db_ref
  j = pl.program_id(0)
  vc0 = off_ref[0] + j * block_v
  v_ok = (vc0 + lax.broadcasted_iota(jnp.int32, (block_v,), 0)) < v
  c_ok = (j * block_v + lax.broadcasted_iota(jnp.int32, (block_v,), 0)) < dz_ref.shape[1]

  def body(kk, acc):
    r_ok = (kk * block_t + lax.broadcasted_iota(jnp.int32, (block_t,), 0)) < t
    g = pltriton.load(dz_ref.at[pl.ds(kk * block_t, block_t), pl.ds(j * block_v, block_v)],
                      mask=r_ok[:, None] & c_ok[None, :], other=0)
    return acc + jnp.sum(g.astype(jnp.float32), axis=0)

  acc = lax.fori_loop(0, pl.cdiv(t, block_t), body, jnp.zeros((block_v,), jnp.float32))
  pltriton.store(db_ref.at[pl.ds(vc0, block_v)], acc.astype(db_ref.dtype), mask=v_ok)


def _dweight_kernel(off_ref, x_ref, dz_ref, dw_in_ref, dw_ref, *, t, h, v, layout, block_t,
                    block_h, block_v, compute_dtype, precision):
  del dw_in_ref  # aliased with dw_ref
  hc0 = pl.program_id(0) * block_h
  j = pl.program_id(1)
  vc0 = off_ref[0] + j * block_v
  h_ok = (hc0 + lax.broadcasted_iota(jnp.int32, (block_h,), 0)) < h
  v_ok = (vc0 + lax.broadcasted_iota(jnp.int32, (block_v,), 0)) < v
  hs = pl.ds(hc0, block_h)

  def body(kk, acc):
    r_ok = (kk * block_t + lax.broadcasted_iota(jnp.int32, (block_t,), 0)) < t
    rs = pl.ds(kk * block_t, block_t)
    x = pltriton.load(x_ref.at[rs, hs], mask=r_ok[:, None] & h_ok[None, :], other=0)
    g = pltriton.load(dz_ref.at[rs, pl.ds(j * block_v, block_v)],
                      mask=jnp.broadcast_to(r_ok[:, None], (block_t, block_v)), other=0)
    x = x.astype(compute_dtype)
    g = g.astype(compute_dtype)
    if layout == "hv":  # dW[h, v] = x^T g
      part = lax.dot_general(x, g, (((0,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
    else:  # dW[v, h] = g^T x
      part = lax.dot_general(g, x, (((0,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
    return acc + part

  shape = (block_h, block_v) if layout == "hv" else (block_v, block_h)
  # Ascending token blocks: deterministic run to run.
  acc = lax.fori_loop(0, pl.cdiv(t, block_t), body, jnp.zeros(shape, jnp.float32))
  vs = pl.ds(vc0, block_v)
  if layout == "hv":
    pltriton.store(dw_ref.at[hs, vs], acc.astype(dw_ref.dtype),
                   mask=h_ok[:, None] & v_ok[None, :])
  else:
    pltriton.store(dw_ref.at[vs, hs], acc.astype(dw_ref.dtype),
                   mask=v_ok[:, None] & h_ok[None, :])


def dbias_call(width: int, *, t: int, v: int, interpret: bool):
  """``db[off:off + width] += sum_t dz[:, :width]`` as ``f(off[1], dz, db) -> db``
  (token blocks of 64, ascending: run-to-run deterministic)."""
  block_v = 128
  return pl.pallas_call(
      functools.partial(_dbias_kernel, t=t, v=v, block_t=64, block_v=block_v),
      grid=(pl.cdiv(width, block_v),),
      out_shape=jax.ShapeDtypeStruct((v,), jnp.float32),
      input_output_aliases={2: 0},
      interpret=interpret,
      name="linear_logp_dbias",
      **_common.triton_compiler_params(4, 2, interpret),
  )


def backward(hidden, weight, bias, targets, lse, mean_z, g_logp, g_ent, *, layout: str,
             temperature, compute_dtype, interpret: bool, vocab_offset: int = 0,
             valid_vocab: int | None = None, chunk: int | None = None,
             config: Config | None = None):
  """Gradients of ``sum(g_logp * logp + g_ent * entropy)``.

  Args:
    hidden ``[T, H]``, weight ``[H, V]`` / ``[V, H]``, bias ``[V]`` or None,
    targets ``[T]`` int32, lse and mean_z ``[T]`` float32 (forward residuals),
    g_logp and g_ent ``[T]`` float32 (zero at masked rows).
    temperature: a Python float or a float32 scalar.
    vocab_offset, valid_vocab: as in :func:`linear_logp_fwd.tile_partials`
      (a vocab shard: the weight's gradient is local to it, ``dh`` is this
      shard's term of a sum over shards).
    chunk: vocab columns per step (default: the config's); a free knob.

  Returns:
    ``(dh, dw, db)``: ``dh`` float32 ``[T, H]``, ``dw`` in ``weight.dtype``,
    ``db`` float32 ``[V]`` or None.
  """
  t, h = hidden.shape
  v = weight.shape[1] if layout == "hv" else weight.shape[0]
  cfg = config or default_config(compute_dtype, interpret)
  if chunk is not None:
    cfg = dataclasses.replace(cfg, chunk=chunk)
  if cfg.chunk % VOCAB_TILE or cfg.chunk % cfg.dh_block_v or cfg.chunk % cfg.dw_block_v:
    raise ValueError(f"linear_logp: chunk={cfg.chunk} must be a multiple of VOCAB_TILE="
                     f"{VOCAB_TILE}, dh_block_v and dw_block_v")
  lcfg = cfg.logits
  compute_dtype = jnp.dtype(compute_dtype)
  chunk = min(cfg.chunk, pl.cdiv(v, VOCAB_TILE) * VOCAB_TILE)
  chunk = pl.cdiv(chunk, max(cfg.dh_block_v, cfg.dw_block_v)) * max(cfg.dh_block_v,
                                                                     cfg.dw_block_v)
  n_chunks = pl.cdiv(v, chunk)
  precision = _common.dot_precision(compute_dtype, interpret)
  has_bias = bias is not None
  temp = sp.temperature_operand(temperature)
  # dz feeds tensor-core products: kept in the compute dtype (bf16 stays bf16).
  dz_dtype = compute_dtype
  n_t = pl.cdiv(t, lcfg.block_t)
  n_vc = chunk // VOCAB_TILE

  dlogits = pl.pallas_call(
      functools.partial(
          _dlogits_kernel, t=t, n_t=n_t, n_v=n_vc, has_bias=has_bias,
          has_temp=temp is not None, block_t=lcfg.block_t, group_t=lcfg.group_t,
          vocab_offset=vocab_offset, h=h, v_local=v if valid_vocab is None else valid_vocab,
          layout=layout, compute_dtype=compute_dtype, precision=precision,
          block_h=fwd.block_h(compute_dtype, interpret)),
      grid=(n_t * n_vc,),
      out_shape=jax.ShapeDtypeStruct((t, chunk), dz_dtype),
      interpret=interpret,
      name="linear_logp_dlogits",
      **fwd.compiler_params(lcfg, interpret),
  )
  dhidden = pl.pallas_call(
      functools.partial(
          _dhidden_kernel, t=t, h=h, v=v, chunk=chunk, layout=layout, block_t=cfg.dh_block_t,
          block_h=cfg.dh_block_h, block_v=cfg.dh_block_v, compute_dtype=compute_dtype,
          precision=precision),
      grid=(pl.cdiv(t, cfg.dh_block_t), pl.cdiv(h, cfg.dh_block_h)),
      out_shape=jax.ShapeDtypeStruct((t, h), jnp.float32),
      input_output_aliases={3: 0},
      interpret=interpret,
      name="linear_logp_dhidden",
      **_params(cfg, interpret),
  )
  dw_shape = jax.ShapeDtypeStruct(weight.shape, weight.dtype)
  db_shape = jax.ShapeDtypeStruct((v,), jnp.float32)
  dweight = pl.pallas_call(
      functools.partial(
          _dweight_kernel, t=t, h=h, v=v, layout=layout, block_t=cfg.dw_block_t,
          block_h=cfg.dw_block_h, block_v=cfg.dw_block_v, compute_dtype=compute_dtype,
          precision=precision),
      grid=(pl.cdiv(h, cfg.dw_block_h), chunk // cfg.dw_block_v),
      out_shape=dw_shape,
      input_output_aliases={3: 0},
      interpret=interpret,
      name="linear_logp_dweight",
      **_params(cfg, interpret),
  )
  dbias = pl.pallas_call(
      functools.partial(_dbias_kernel, t=t, v=v, block_t=cfg.dw_block_t,
                        block_v=cfg.dw_block_v),
      grid=(chunk // cfg.dw_block_v,),
      out_shape=db_shape,
      input_output_aliases={2: 0},
      interpret=interpret,
      name="linear_logp_dbias",
      **_params(cfg, interpret),
  )
  side = [x for x in (bias, temp) if x is not None]
  residual = [targets, lse, mean_z, g_logp, g_ent]

  def step(c, carry):
    dh, dw, db = carry
    off = (c * chunk).astype(jnp.int32).reshape(1)
    dz = dlogits(off, hidden, weight, *side, *residual)
    dh = dhidden(off, dz, weight, dh)
    dw = dweight(off, hidden, dz, dw)
    if has_bias:
      db = dbias(off, dz, db)
    return dh, dw, db

  init = (jnp.zeros((t, h), jnp.float32), jnp.zeros(weight.shape, weight.dtype),
          jnp.zeros((v,), jnp.float32) if has_bias else None)
  # A loop (not unrolled) so that exactly one dz chunk is live at a time.
  dh, dw, db = lax.fori_loop(0, n_chunks, step, init)
  return dh, dw, db
