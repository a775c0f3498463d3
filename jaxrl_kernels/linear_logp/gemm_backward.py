"""The ``linear_logp`` backward on ``det_matmul``'s kernels: three GEMMs per vocab chunk.

Per vocab chunk ``c`` (``chunk`` columns, a ``lax.fori_loop``; a static tail):

    z_c  = (h W_c + b_c) / temperature        det GEMM, float32 out, [T, chunk]
    dz_c = (g_logp (onehot - p) - g_ent p (z_c - mean_z)) / temperature   elementwise
    dH  += dz_c W_c^T                         det GEMM, float32, ascending chunks
    dW_c = h^T dz_c                           det GEMM (tokens reduced in K tiles)

Every product is a ``det_matmul`` kernel, whose rows never depend on M, and
the chunks are added in ascending order, so dH rows stay batch-invariant; dW
is run-to-run deterministic. ``db`` uses the Triton column-sum kernel.

With a GEMM backend that has ``epilogues`` (``"mosaic"``, Hopper) two epilogues
of the Mosaic GEMM remove passes over memory, each bitwise the unfused form: ``fuse_dz`` computes
``dz_c`` in the logits GEMM's epilogue (z never leaves registers), and
``accumulate`` adds the dH product into dH in the dH GEMM's epilogue, in place
(no product buffer, no add pass; ``dh_rows`` is then unused). Otherwise the dH
product is added in ``[dh_rows, H]`` blocks. Memory per chunk: float32 ``z_c``
and ``dz_c`` in the compute dtype (``[T, chunk]`` each), the float32 ``[T, H]``
dH accumulator; no ``[T, V]`` array. The weight chunk is sliced (copied) per
step: ``chunk * H`` elements. The defaults (chunk 4096, the dH product blocked
only past 8192 tokens) are the fastest of the measured settings
(benchmarks/results/linear_logp.md); none changes a bit.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jaxrl_kernels.gemm import matmul2d
from jaxrl_kernels.gemm.api import backend as gemm_backend
from jaxrl_kernels.pallas import gemm_mosaic
from jaxrl_kernels.pallas import linear_logp_bwd as bwd
from jaxrl_kernels.pallas import softmax_partials as sp


def product_implementation(gemm: str, n: int, k: int, dtype) -> str:
  """The GEMM kernel of one ``[M, K] x [K, N]`` product: ``gemm`` where it takes the
  weight's N and K (never decided by M), else its fallback (Mosaic: Triton)."""
  be = gemm_backend(gemm)
  if be.fallback is not None and be.supported(n, k, dtype) is not None:
    return be.fallback
  return gemm


def _mosaic_runs(m: int, n: int, k: int, rhs_transposed: bool) -> bool:
  return gemm_mosaic.supported_shape(m, n, k, gemm_mosaic.default_config(m, n, k),
                                     lhs_transposed=False, rhs_transposed=rhs_transposed) is None


def backward(hidden, weight, bias, targets, lse, mean_z, g_logp, g_ent, *, layout: str,
             temperature, compute_dtype, gemm: str, vocab_offset: int = 0,
             valid_vocab: int | None = None, chunk: int = 4096, dh_rows: int = 8192,
             accumulate: bool = True, fuse_dz: bool = True, entropy: bool = True):
  """The gradients of ``pallas.linear_logp_bwd.backward`` (same arguments and
  outputs) with the products on ``det_matmul``'s ``gemm`` kernels (``"mosaic"``,
  ``"triton"`` or ``"interpret"``).

  ``accumulate`` and ``fuse_dz`` take effect with ``gemm="mosaic"`` (a backend with
  ``epilogues``) where every
  chunk width's product runs on the Mosaic kernel (static shapes only); they
  never change the bits.

  ``entropy=False``: the op returned no entropy, so its cotangent is zero; ``g_ent`` and
  ``mean_z`` are not read and ``dz`` has no entropy term (``g_logp (onehot - p) /
  temperature``: the values of ``g_ent = 0`` up to the sign of a zero).

  Returns:
    ``(dh, dw, db)``: ``dh`` float32 ``[T, H]``, ``dw`` in ``weight.dtype``,
    ``db`` float32 ``[V]`` or None.
  """
  t, h = hidden.shape
  hv = layout == "hv"
  v = weight.shape[1] if hv else weight.shape[0]
  v_local = v if valid_vocab is None else valid_vocab
  compute_dtype = jnp.dtype(compute_dtype)
  interpret = gemm == "interpret"
  x = hidden.astype(compute_dtype)
  local_t = targets - vocab_offset
  temp = sp.temperature_operand(temperature)
  tscale = None if temp is None else temp[0]
  has_bias = bias is not None

  def mm(lhs, rhs, *, n, k, **kw):
    return matmul2d(lhs, rhs, implementation=product_implementation(gemm, n, k, compute_dtype),
                    **kw)

  # Chunk widths: ``chunk`` and the tail; the fused epilogues need every
  # product of every width on the Mosaic kernel.
  widths = {min(chunk, v), v % min(chunk, v) or min(chunk, v)}
  epilogues = gemm_backend(gemm).epilogues
  accumulate = (epilogues and accumulate
                and all(_mosaic_runs(t, h, w_, hv) for w_ in widths))
  fuse_dz = (epilogues and fuse_dz
             and all(_mosaic_runs(t, w_, h, not hv) for w_ in widths))

  def dz_epilogue(z, rows, cols, col_ids):
    """dz of one output tile from its float32 logits: the ops of :func:`dz_xla`."""
    if entropy:
      lse_r, mean_r, gl_r, ge_r, t_r = rows
    else:
      (lse_r, gl_r, t_r), mean_r, ge_r = rows, None, None
    bias_col = cols[0] if has_bias else None
    temp_col = cols[int(has_bias)] if temp is not None else None
    z = sp.scale_logits(z, bias_col, temp_col)
    ok = cols[-1] != 0
    onehot = (col_ids == t_r).astype(jnp.float32)
    dz = sp.logit_grad(z, lse_r, mean_r, onehot, gl_r, ge_r, ok, temp_col, mask_p=True)
    return jnp.where(ok, dz, 0.0)

  def dz_xla(c0, width, w_c, cols):
    z = mm(x, w_c, n=width, k=h, lhs_transposed=False, rhs_transposed=not hv,
           out_dtype=jnp.float32)
    bias_row = None
    if has_bias:
      bias_row = lax.dynamic_slice_in_dim(bias, c0, width).astype(jnp.float32)[None, :]
    z = sp.scale_logits(z, bias_row, tscale)
    ok = cols < v_local
    onehot = (cols == local_t[:, None]).astype(jnp.float32)
    dz = sp.logit_grad(z, lse[:, None], mean_z[:, None], onehot, g_logp[:, None],
                       g_ent[:, None] if entropy else None, ok, tscale, mask_p=True)
    return jnp.where(ok, dz, 0.0).astype(compute_dtype)

  def grads(c0, width, dh, dw, db):
    w_c = lax.dynamic_slice_in_dim(weight, c0, width, axis=1 if hv else 0).astype(compute_dtype)
    cols = c0 + lax.broadcasted_iota(jnp.int32, (1, width), 1)
    if fuse_dz:
      col_ops = (lax.dynamic_slice_in_dim(bias, c0, width).astype(jnp.float32),) if has_bias \
          else ()
      if temp is not None:
        col_ops += (jnp.broadcast_to(temp, (width,)),)
      col_ops += ((cols[0] < v_local).astype(jnp.int32),)
      t_rows = (local_t - c0).astype(jnp.int32)
      rows = ((lse, mean_z, g_logp, g_ent, t_rows) if entropy else (lse, g_logp, t_rows))
      dz = gemm_mosaic.matmul(x, w_c, lhs_transposed=False, rhs_transposed=not hv,
                              out_dtype=compute_dtype, epilogue=dz_epilogue,
                              row_operands=rows, col_operands=col_ops)
    else:
      dz = dz_xla(c0, width, w_c, cols)
    return accumulate_grads(c0, width, w_c, dz, dh, dw, db)

  def accumulate_grads(c0, width, w_c, dz, dh, dw, db):
    if accumulate:
      # dH + dz_c W_c^T in the GEMM's epilogue, in place (gemm_mosaic.matmul's
      # acc): bitwise the add below, with no product buffer and no add pass.
      dh = gemm_mosaic.matmul(dz, w_c, lhs_transposed=False, rhs_transposed=hv,
                              out_dtype=jnp.float32, acc=dh)
    # dH += dz_c W_c^T in token blocks: a [dh_rows, H] float32 product at a time,
    # not a second [T, H] one.
    for r0 in range(0, 0 if accumulate else t, dh_rows):
      r1 = min(t, r0 + dh_rows)
      prod = mm(dz[r0:r1], w_c, n=h, k=width, lhs_transposed=False, rhs_transposed=hv,
                out_dtype=jnp.float32)
      # A dynamic_update_slice of the carry: updated in place (``.at[].add``
      # lowers to a scatter, which XLA ran as a full copy per block).
      dh = lax.dynamic_update_slice(dh, lax.dynamic_slice_in_dim(dh, r0, r1 - r0) + prod,
                                    (r0, 0))
    # dW products reduce over tokens: their kernel may depend on T (dW is only
    # deterministic run to run); matmul2d's Mosaic backend falls back by itself.
    if hv:
      dw_c = matmul2d(x, dz, lhs_transposed=True, rhs_transposed=False, out_dtype=weight.dtype,
                      implementation=gemm)
      dw = lax.dynamic_update_slice(dw, dw_c, (0, c0))
    else:
      dw_c = matmul2d(dz, x, lhs_transposed=True, rhs_transposed=False, out_dtype=weight.dtype,
                      implementation=gemm)
      dw = lax.dynamic_update_slice(dw, dw_c, (c0, 0))
    if has_bias:
      db = dbias(width)(jnp.reshape(c0, (1,)).astype(jnp.int32), dz, db)
    return dh, dw, db

  dbias = functools.partial(bwd.dbias_call, t=t, v=v, interpret=interpret)
  chunk = min(chunk, v)
  n_full, tail = divmod(v, chunk)
  carry = (jnp.zeros((t, h), jnp.float32), jnp.zeros(weight.shape, weight.dtype),
           jnp.zeros((v,), jnp.float32) if has_bias else None)
  carry = lax.fori_loop(0, n_full, lambda c, cr: grads(c * chunk, chunk, *cr), carry)
  if tail:
    carry = grads(n_full * chunk, tail, *carry)
  return carry
