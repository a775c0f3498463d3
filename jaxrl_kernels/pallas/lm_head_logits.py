"""``linear_logp``'s Triton logits tile with a store epilogue, and the partials of
stored logits (Triton lowering on GPU, the Pallas interpreter on CPU).

* :func:`logits`: program ``(i, j)`` computes the tile ``z`` of
  ``linear_logp_fwd.logits_tile`` (the fused forward's own code, its contract
  ``block_h`` and its tuning config) and stores it; with ``return_stats`` it
  also reduces the same registers to the fused kernel's ``(m, s, u)`` with
  ``softmax_partials.tile_stats``. Every logit is bitwise the one the fused op
  reduces.
* :func:`partials_from_logits`: ``(m, s, u, target_logit)`` of given float32
  logits, tile by tile with the same statistics code (bitwise the fused op's
  under the interpreter; within a relative 1e-6 compiled, where a reduction of
  re-read logits may compile differently from the fused epilogue).
"""

from __future__ import annotations

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


def _logits_kernel(h_ref, w_ref, *refs, t, h, v, n_t, n_v, has_bias, has_temp, group_t,
                   stats, interpret, **tile_kw):
  b_ref, temperature, (o_ref, *stat_refs) = fwd.split_refs(refs, has_bias=has_bias,
                                                           has_temp=has_temp)
  i, j = _common.group_swizzle(pl.program_id(0), n_t, n_v, group_t)
  row0 = i * tile_kw["block_t"]
  col0 = j * VOCAB_TILE
  z, _, _, row_ok, col_ok = fwd.logits_tile(h_ref, w_ref, b_ref, row0, col0, t=t, h=h,
                                            v_local=v, temperature=temperature, **tile_kw)
  pltriton.store(o_ref.at[pl.ds(row0, tile_kw["block_t"]), pl.ds(col0, VOCAB_TILE)], z,
                 mask=row_ok[:, None] & col_ok[None, :])
  if stats:
    # The fused kernel's reduction of the same registers, in the same kernel: a
    # from-logits kernel, whose z is a load, compiled u = sum e (z - m)
    # differently on Hopper (last bit, a few rows).
    m, s, u = sp.tile_stats(z, col_ok, interpret=interpret)
    for ref, x in zip(stat_refs, (m, s, u)):
      pltriton.store(ref.at[j, pl.ds(row0, tile_kw["block_t"])], x, mask=row_ok)


def logits(hidden2d: jax.Array, weight: jax.Array, bias: jax.Array | None, *, layout: str,
           temperature, compute_dtype, interpret: bool, return_stats: bool = False):
  """Float32 ``[T, V]`` logits ``(h W + b) / temperature`` with the fused op's bits,
  or ``(z, (m, s, u))`` with its per-tile partials (``[n_tiles, T]`` each)."""
  t, hd = hidden2d.shape
  v = weight.shape[1] if layout == "hv" else weight.shape[0]
  cfg = fwd.default_config(compute_dtype, interpret)  # the fused op's tiles
  n_t = pl.cdiv(t, cfg.block_t)
  n_v = pl.cdiv(v, VOCAB_TILE)
  temp = sp.temperature_operand(temperature)
  kernel = functools.partial(
      _logits_kernel, t=t, h=hd, v=v, n_t=n_t, n_v=n_v, has_bias=bias is not None,
      has_temp=temp is not None, group_t=cfg.group_t, block_t=cfg.block_t,
      block_h=fwd.block_h(compute_dtype, interpret), layout=layout,
      compute_dtype=jnp.dtype(compute_dtype),
      precision=_common.dot_precision(compute_dtype, interpret), stats=return_stats,
      interpret=interpret)
  args = [hidden2d, weight] + [x for x in (bias, temp) if x is not None]
  out_shape = [jax.ShapeDtypeStruct((t, v), jnp.float32)]
  if return_stats:
    out_shape += [jax.ShapeDtypeStruct((n_v, t), jnp.float32)] * 3
  out = pl.pallas_call(
      kernel,
      grid=(n_t * n_v,),
      out_shape=tuple(out_shape),
      interpret=interpret,
      name="lm_head_logits",
      **fwd.compiler_params(cfg, interpret),
  )(*args)
  return (out[0], tuple(out[1:])) if return_stats else out[0]


def _partials_kernel(z_ref, tg_ref, tz0_ref, m_ref, s_ref, u_ref, tz_ref, *, t, v, n_t, n_v,
                     block_t, group_t, interpret):
  del tz0_ref  # aliased to tz_ref: rows whose target is not in this tile keep their 0
  i, j = _common.group_swizzle(pl.program_id(0), n_t, n_v, group_t)
  row0 = i * block_t
  col0 = j * VOCAB_TILE
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_t,), 0)
  cols = col0 + lax.broadcasted_iota(jnp.int32, (VOCAB_TILE,), 0)
  row_ok = rows < t
  col_ok = cols < v
  z = pltriton.load(z_ref.at[pl.ds(row0, block_t), pl.ds(col0, VOCAB_TILE)],
                    mask=row_ok[:, None] & col_ok[None, :], other=0)
  z = jnp.where(col_ok[None, :], z, -jnp.inf)
  m, s, u = sp.tile_stats(z, col_ok, interpret=interpret)
  pltriton.store(m_ref.at[j, pl.ds(row0, block_t)], m, mask=row_ok)
  pltriton.store(s_ref.at[j, pl.ds(row0, block_t)], s, mask=row_ok)
  pltriton.store(u_ref.at[j, pl.ds(row0, block_t)], u, mask=row_ok)
  tg = pltriton.load(tg_ref.at[pl.ds(row0, block_t)], mask=row_ok, other=-1)
  tz = sp.target_logit(z, (cols[None, :] == tg[:, None]) & col_ok[None, :])
  owns = row_ok & sp.owns_target(tg, col0, jnp.minimum(col0 + VOCAB_TILE, v))
  pltriton.store(tz_ref.at[pl.ds(row0, block_t)], tz, mask=owns)


def partials_from_logits(logits2d: jax.Array, targets: jax.Array, *, compute_dtype,
                         interpret: bool):
  """``(m, s, u, target_logit)`` of float32 logits ``[T, V]`` on the fused Triton
  kernel's tiles (``compute_dtype`` picks its token tile, as the head's op does)."""
  t, v = logits2d.shape
  cfg = fwd.default_config(compute_dtype, interpret)
  n_t, n_v = pl.cdiv(t, cfg.block_t), pl.cdiv(v, VOCAB_TILE)
  part = jax.ShapeDtypeStruct((n_v, t), jnp.float32)
  return pl.pallas_call(
      functools.partial(_partials_kernel, t=t, v=v, n_t=n_t, n_v=n_v, block_t=cfg.block_t,
                        group_t=cfg.group_t, interpret=interpret),
      grid=(n_t * n_v,),
      out_shape=(part, part, part, jax.ShapeDtypeStruct((t,), jnp.float32)),
      input_output_aliases={2: 3},
      interpret=interpret,
      name="lm_head_logits_partials",
      **fwd.compiler_params(cfg, interpret),
  )(logits2d, targets, jnp.zeros((t,), jnp.float32))
