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
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_kernels.pallas import linear_logp_fwd as fwd
from jaxrl_kernels.pallas.linear_logp_fwd import VOCAB_TILE


@dataclasses.dataclass(frozen=True)
class BwdConfig:
  """Free tiling knobs of the backward (the defaults never depend on T).

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
  logits: fwd.TuningConfig = fwd.TuningConfig()
  dh_block_t: int = 128
  dh_block_h: int = 128
  dh_block_v: int = 64
  dw_block_h: int = 128
  dw_block_v: int = 128
  dw_block_t: int = 64
  num_warps: int = 8
  num_stages: int = 3


def default_config(compute_dtype, interpret: bool) -> BwdConfig:
  logits = fwd.default_config(compute_dtype, interpret)
  if interpret:
    return BwdConfig(chunk=512, logits=logits, dh_block_t=32, dh_block_h=64, dh_block_v=128,
                     dw_block_h=64, dw_block_v=128, dw_block_t=32)
  if jnp.dtype(compute_dtype) == jnp.float32:
    return BwdConfig(chunk=4096, logits=logits, dh_block_t=64, dh_block_h=64, dh_block_v=32,
                     dw_block_h=64, dw_block_v=64, dw_block_t=32, num_warps=4, num_stages=3)
  return BwdConfig(chunk=4096, logits=logits)


def _params(cfg: BwdConfig, interpret: bool) -> dict:
  if interpret:
    return {}
  return {"compiler_params": pltriton.CompilerParams(num_warps=cfg.num_warps,
                                                     num_stages=cfg.num_stages)}


def _dlogits_kernel(*refs, t, n_t, n_v, has_bias, block_t, group_t, temperature,
                    vocab_offset, **tile_kw):
  if has_bias:
    off_ref, h_ref, w_ref, b_ref, tg_ref, lse_ref, mean_ref, gl_ref, ge_ref, dz_ref = refs
  else:
    off_ref, h_ref, w_ref, tg_ref, lse_ref, mean_ref, gl_ref, ge_ref, dz_ref = refs
    b_ref = None
  i, j = fwd.swizzle(pl.program_id(0), n_t, n_v, group_t)
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
  p = jnp.exp(z - lse[:, None])  # 0 on masked columns (z = -inf)
  zc = jnp.where(col_ok[None, :], z - mean[:, None], 0.0)
  onehot = (cols[None, :] == tg[:, None]).astype(jnp.float32)
  dz = gl[:, None] * (onehot - p) - ge[:, None] * (p * zc)
  if temperature != 1.0:
    dz = dz / jnp.float32(temperature)
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

  Its own kernel: on an H100 (jax 0.11.2) folding this sum into the dW kernel
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


def backward(hidden, weight, bias, targets, lse, mean_z, g_logp, g_ent, *, layout: str,
             temperature: float, compute_dtype, interpret: bool, vocab_offset: int = 0,
             valid_vocab: int | None = None, config: BwdConfig | None = None):
  """Gradients of ``sum(g_logp * logp + g_ent * entropy)``.

  Args:
    hidden ``[T, H]``, weight ``[H, V]`` / ``[V, H]``, bias ``[V]`` or None,
    targets ``[T]`` int32, lse and mean_z ``[T]`` float32 (forward residuals),
    g_logp and g_ent ``[T]`` float32 (zero at masked rows).
    vocab_offset, valid_vocab: as in :func:`linear_logp_fwd.tile_partials`
      (a vocab shard: the weight's gradient is local to it, ``dh`` is this
      shard's term of a sum over shards).

  Returns:
    ``(dh, dw, db)``: ``dh`` float32 ``[T, H]``, ``dw`` in ``weight.dtype``,
    ``db`` float32 ``[V]`` or None.
  """
  t, h = hidden.shape
  v = weight.shape[1] if layout == "hv" else weight.shape[0]
  cfg = config or default_config(compute_dtype, interpret)
  if cfg.chunk % VOCAB_TILE or cfg.chunk % cfg.dh_block_v or cfg.chunk % cfg.dw_block_v:
    raise ValueError(f"linear_logp: chunk={cfg.chunk} must be a multiple of VOCAB_TILE="
                     f"{VOCAB_TILE}, dh_block_v and dw_block_v")
  lcfg = cfg.logits
  compute_dtype = jnp.dtype(compute_dtype)
  chunk = min(cfg.chunk, pl.cdiv(v, VOCAB_TILE) * VOCAB_TILE)
  chunk = pl.cdiv(chunk, max(cfg.dh_block_v, cfg.dw_block_v)) * max(cfg.dh_block_v,
                                                                     cfg.dw_block_v)
  n_chunks = pl.cdiv(v, chunk)
  precision = fwd.dot_precision(compute_dtype, interpret)
  has_bias = bias is not None
  # dz feeds tensor-core products: kept in the compute dtype (bf16 stays bf16).
  dz_dtype = compute_dtype
  n_t = pl.cdiv(t, lcfg.block_t)
  n_vc = chunk // VOCAB_TILE

  dlogits = pl.pallas_call(
      functools.partial(
          _dlogits_kernel, t=t, n_t=n_t, n_v=n_vc, has_bias=has_bias,
          block_t=lcfg.block_t, group_t=lcfg.group_t, temperature=float(temperature),
          vocab_offset=vocab_offset, h=h, v_local=v if valid_vocab is None else valid_vocab,
          layout=layout, compute_dtype=compute_dtype, precision=precision,
          block_h=lcfg.block_h),
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
  side = [bias] if has_bias else []
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


def backward_gemm(hidden, weight, bias, targets, lse, mean_z, g_logp, g_ent, *, layout: str,
                  temperature: float, compute_dtype, gemm: str, vocab_offset: int = 0,
                  valid_vocab: int | None = None, chunk: int = 4096, dh_rows: int = 8192,
                  interpret: bool = False):
  """The same gradients as :func:`backward`, with the three products on ``det_matmul``'s
  kernels (``gemm="mosaic"`` on Hopper: TMA + wgmma) and the cotangent in between.

  Per vocab chunk ``c`` (``chunk`` columns, a ``lax.fori_loop``; a static tail):

      z_c  = (h W_c + b_c) / temperature        det GEMM, float32 out, [T, chunk]
      dz_c = (g_logp (onehot - p) - g_ent p (z_c - mean_z)) / temperature   elementwise
      dH  += dz_c W_c^T                         det GEMM, float32, ascending chunks
      dW_c = h^T dz_c                           det GEMM (tokens reduced in K tiles)

  Every product is a ``det_matmul`` kernel, whose rows never depend on M, and
  the chunks are added in ascending order, so dH rows stay batch-invariant;
  dW is run-to-run deterministic. ``db`` uses the Triton column-sum kernel.
  Memory per chunk: float32 ``z_c`` and ``dz_c`` in the compute dtype (``[T,
  chunk]`` each), the float32 ``[T, H]`` dH accumulator and a ``[dh_rows, H]``
  product added into it; no ``[T, V]`` array. With ``gemm="mosaic"`` the
  product is added in the dH GEMM's epilogue into dH in place (no product
  buffer, no add pass; bitwise the same sums; ``JAXRL_KERNELS_LOGP_BWD_ACC=0``
  turns it off) and ``dh_rows`` is unused. The weight chunk is sliced
  (copied) per step: ``chunk * H`` elements. Measured on an H100 at T=8192,
  H=4096, V=151936 (bf16), forward+backward against materialized XLA:
  chunk=4096 with dH in one product 0.76x (288 MiB of temporaries, 2.0% of
  XLA's); with 2048-row dH blocks 0.83x; chunk=2048 0.99x. Hence the defaults:
  the dH product is blocked only past 8192 tokens.
  """
  from jaxrl_kernels.gemm.api import _gemm2d

  t, h = hidden.shape
  hv = layout == "hv"
  v = weight.shape[1] if hv else weight.shape[0]
  v_local = v if valid_vocab is None else valid_vocab
  compute_dtype = jnp.dtype(compute_dtype)
  x = hidden.astype(compute_dtype)
  local_t = targets - vocab_offset
  mm = functools.partial(_gemm2d, implementation=gemm)
  # Mosaic accumulates dH in the dH GEMM's epilogue (acc operand).
  def mosaic_runs(m, n, k, rhs_transposed):
    from jaxrl_kernels.pallas import gemm_mosaic as gm
    return gm.supported_shape(m, n, k, gm.default_config(m, n, k), lhs_transposed=False,
                              rhs_transposed=rhs_transposed) is None

  # Chunk widths: ``chunk`` and the tail; the fused epilogues need every
  # product of every width on the Mosaic kernel (static shapes only).
  widths = {min(chunk, v), v % min(chunk, v) or min(chunk, v)}
  accumulate = (gemm == "mosaic" and os.environ.get("JAXRL_KERNELS_LOGP_BWD_ACC", "1") != "0"
                and all(mosaic_runs(t, h, w_, hv) for w_ in widths))
  if gemm == "mosaic":
    from jaxrl_kernels.pallas import gemm_mosaic
  if accumulate:

    def mosaic_acc(dz, w_c, dh):
      return gemm_mosaic.matmul(dz, w_c, lhs_transposed=False, rhs_transposed=hv,
                                out_dtype=jnp.float32, acc=dh)
  has_bias = bias is not None
  dbias = None
  if has_bias:
    block_v = 128
    dbias = lambda width: pl.pallas_call(  # noqa: E731
        functools.partial(_dbias_kernel, t=t, v=v, block_t=64, block_v=block_v),
        grid=(pl.cdiv(width, block_v),),
        out_shape=jax.ShapeDtypeStruct((v,), jnp.float32),
        input_output_aliases={2: 0},
        interpret=interpret,
        name="linear_logp_dbias",
        **({} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=4,
                                                                            num_stages=2)}),
    )

  # Mosaic computes dz in the logits GEMM's epilogue: z never leaves registers.
  fuse_dz = (gemm == "mosaic" and os.environ.get("JAXRL_KERNELS_LOGP_BWD_DZ", "1") != "0"
             and all(mosaic_runs(t, w_, h, not hv) for w_ in widths))

  def dz_epilogue(z, rows, cols, col_ids):
    """dz of one output tile from its float32 logits: the ops of the XLA form below."""
    lse_r, mean_r, gl_r, ge_r, t_r = rows
    z = z + cols[0] if has_bias else z
    if temperature != 1.0:
      z = z / jnp.float32(temperature)
    ok = cols[-1] != 0
    p = jnp.where(ok, jnp.exp(z - lse_r), 0.0)
    onehot = (col_ids == t_r).astype(jnp.float32)
    dz = gl_r * (onehot - p) - ge_r * (p * jnp.where(ok, z - mean_r, 0.0))
    if temperature != 1.0:
      dz = dz / jnp.float32(temperature)
    return jnp.where(ok, dz, 0.0)

  def grads(c0, width, dh, dw, db):
    w_c = lax.dynamic_slice_in_dim(weight, c0, width, axis=1 if hv else 0).astype(compute_dtype)
    cols = c0 + lax.broadcasted_iota(jnp.int32, (1, width), 1)
    if fuse_dz:
      col_ops = (lax.dynamic_slice_in_dim(bias, c0, width).astype(jnp.float32),) if has_bias \
          else ()
      col_ops += ((cols[0] < v_local).astype(jnp.int32),)
      rows = (lse, mean_z, g_logp, g_ent, (local_t - c0).astype(jnp.int32))
      dz = gemm_mosaic.matmul(x, w_c, lhs_transposed=False, rhs_transposed=not hv,
                              out_dtype=compute_dtype, epilogue=dz_epilogue,
                              row_operands=rows, col_operands=col_ops)
    else:
      dz = dz_xla(c0, width, w_c, cols)
    return accumulate_grads(c0, width, w_c, dz, dh, dw, db)

  def dz_xla(c0, width, w_c, cols):
    z = mm(x, w_c, lhs_transposed=False, rhs_transposed=not hv, out_dtype=jnp.float32)
    if has_bias:
      z = z + lax.dynamic_slice_in_dim(bias, c0, width).astype(jnp.float32)[None, :]
    if temperature != 1.0:
      z = z / jnp.float32(temperature)
    ok = cols < v_local
    p = jnp.where(ok, jnp.exp(z - lse[:, None]), 0.0)
    onehot = (cols == local_t[:, None]).astype(jnp.float32)
    dz = g_logp[:, None] * (onehot - p) - g_ent[:, None] * (p * jnp.where(ok, z - mean_z[:, None],
                                                                         0.0))
    if temperature != 1.0:
      dz = dz / jnp.float32(temperature)
    return jnp.where(ok, dz, 0.0).astype(compute_dtype)

  def accumulate_grads(c0, width, w_c, dz, dh, dw, db):
    if accumulate:
      # dH + dz_c W_c^T in the GEMM's epilogue, in place (gemm_mosaic.matmul's
      # acc): bitwise the add below, with no product buffer and no add pass.
      dh = mosaic_acc(dz, w_c, dh)
    # dH += dz_c W_c^T in token blocks: a [dh_rows, H] float32 product at a time,
    # not a second [T, H] one.
    for r0 in range(0, 0 if accumulate else t, dh_rows):
      r1 = min(t, r0 + dh_rows)
      prod = mm(dz[r0:r1], w_c, lhs_transposed=False, rhs_transposed=hv, out_dtype=jnp.float32)
      # A dynamic_update_slice of the carry: updated in place (``.at[].add``
      # lowers to a scatter, which XLA ran as a full copy per block).
      dh = lax.dynamic_update_slice(dh, lax.dynamic_slice_in_dim(dh, r0, r1 - r0) + prod,
                                    (r0, 0))
    if hv:
      dw_c = mm(x, dz, lhs_transposed=True, rhs_transposed=False, out_dtype=weight.dtype)
      dw = lax.dynamic_update_slice(dw, dw_c, (0, c0))
    else:
      dw_c = mm(dz, x, lhs_transposed=True, rhs_transposed=False, out_dtype=weight.dtype)
      dw = lax.dynamic_update_slice(dw, dw_c, (c0, 0))
    if has_bias:
      db = dbias(width)(jnp.reshape(c0, (1,)).astype(jnp.int32), dz, db)
    return dh, dw, db

  chunk = min(chunk, v)
  n_full, tail = divmod(v, chunk)
  carry = (jnp.zeros((t, h), jnp.float32), jnp.zeros(weight.shape, weight.dtype),
           jnp.zeros((v,), jnp.float32) if has_bias else None)
  carry = lax.fori_loop(0, n_full, lambda c, cr: grads(c * chunk, chunk, *cr), carry)
  if tail:
    carry = grads(n_full * chunk, tail, *carry)
  return carry


def gemm_backend(implementation: str, compute_dtype) -> str | None:
  """The ``det_matmul`` kernel that runs the backward's products, or None for the
  fused Triton kernels of :func:`backward`.

  On Hopper with bf16/fp16 products: ``"mosaic"`` (TMA + wgmma GEMMs, much
  faster than the Triton lowering there). Everywhere else: None. The
  environment variable ``JAXRL_KERNELS_LOGP_BWD=fused`` forces the fused
  kernels (for benchmarks).
  """
  import os

  from jaxrl_kernels import _backend
  if os.environ.get("JAXRL_KERNELS_LOGP_BWD", "") == "fused":
    return None
  if (implementation in ("triton", "mosaic") and _backend.is_hopper()
      and jnp.dtype(compute_dtype).name in ("bfloat16", "float16")):
    return "mosaic"
  return None


def backward_auto(hidden, weight, bias, targets, lse, mean_z, g_logp, g_ent, *, layout: str,
                  temperature: float, compute_dtype, implementation: str, vocab_offset: int = 0,
                  valid_vocab: int | None = None):
  """:func:`backward_gemm` where :func:`gemm_backend` names a GEMM, else :func:`backward`.

  ``JAXRL_KERNELS_LOGP_BWD_CHUNK`` / ``_DH_ROWS`` override the GEMM path's free
  ``chunk`` and ``dh_rows`` (benchmarks; neither changes dH's bits per row).
  """
  import os

  kw = dict(layout=layout, temperature=temperature, compute_dtype=compute_dtype,
            vocab_offset=vocab_offset, valid_vocab=valid_vocab,
            interpret=implementation == "interpret")
  args = (hidden, weight, bias, targets, lse, mean_z, g_logp, g_ent)
  gemm = gemm_backend(implementation, compute_dtype)
  if gemm is None:
    return backward(*args, **kw)
  env = {name: f"JAXRL_KERNELS_LOGP_BWD_{name.upper()}" for name in ("chunk", "dh_rows")}
  tune = {name: int(os.environ[var]) for name, var in env.items() if var in os.environ}
  return backward_gemm(*args, gemm=gemm, **kw, **tune)
