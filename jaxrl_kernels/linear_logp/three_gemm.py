"""The fused objective's head in three GEMMs: the logits computed once per token chunk.

For a token-level objective (the cotangent of token ``t`` a function of token ``t``'s own
``logp`` and ``entropy`` and of values known before the pass), per chunk of ``Tc`` tokens in
ascending order:

    z_c, (m, s, u) = logits(h_c)             GEMM 1: the backend's logits kernel with its
                                             in-kernel statistics (``head_logits_partials``)
    lse, mean_z, entropy = merge(m, s, u)    the op's merge, ascending vocab tiles
    logp = z_c[t] - lse                      ``finalize``: ``linear_logp``'s bits
    g_logp, g_ent = token_grad(logp, entropy, operands_c)
    dz_c = (g_logp (onehot - p) - g_ent p (z_c - mean_z)) / temperature   elementwise
    dH_c = dz_c W^T                          GEMM 2: one product over the whole vocabulary
    dW  += h_b^T dz_b, db += colsum(dz_b)    GEMM 3, per OBJECTIVE_DW_TOKEN_BLOCK rows b

Bits:

* ``logp`` and ``entropy`` are ``linear_logp``'s: the logits kernel stores the very logits
  the fused op reduces and reduces them with the fused op's tile code (``head_logits``'
  contract), the merge and ``finalize`` are the op's, and every one of them is row-wise.
* dH rows: a row of ``dz_c W^T`` is one ``det_matmul`` row (its K, the vocabulary, walked in
  the GEMM's fixed K tiles), whatever the chunk's other rows: invariant to the batch, the
  padding and ``Tc``.
* dW and db: ``dW = (((0 + P_0) + P_1) + ...)`` with ``P_b = h_b^T dz_b`` the float32 product
  of token rows ``[b B, (b + 1) B)``, ``B = contract.OBJECTIVE_DW_TOKEN_BLOCK``, from zero,
  in ascending ``b``. ``Tc`` is a multiple of ``B``, so the blocks, their products and the
  order of the additions do not depend on ``Tc``; padding rows (zero hidden rows, zero
  cotangents) give products of exact zeros, which leave the sum unchanged. Deterministic run
  to run and independent of ``Tc``; dependent on the batch (as every dW).

Memory per step: float32 ``z_c [Tc, V]`` and ``dz_c [Tc, V]`` in the compute dtype, the
float32 ``[T, H]`` dH, and a float32 dW accumulator of the weight's shape (for a 16-bit
weight twice its gradient's bytes; see docs/linear_logp.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels import contract
from jaxrl_kernels.gemm import matmul2d
from jaxrl_kernels.gemm.api import backend as gemm_backend
from jaxrl_kernels.linear_logp import gemm_backward
from jaxrl_kernels.pallas import gemm_mosaic
from jaxrl_kernels.pallas import softmax_partials as sp

DW_TOKEN_BLOCK = contract.OBJECTIVE_DW_TOKEN_BLOCK
#: The default token chunk: float32 z_c and dz_c of 256 rows at V = 151936 are 233 MB
#: (bf16 dz), under 2% of the materialized head's temporaries (docs/linear_logp.md).
DEFAULT_TOKEN_CHUNK = DW_TOKEN_BLOCK


def _pad_rows(x: jax.Array, rows: int, value=0) -> jax.Array:
  pad = rows - x.shape[0]
  if not pad:
    return x
  return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def _token_leaves(operands, t_pad: int):
  """The token operands (``[T]`` leaves and scalars, as ``objective._per_token`` checked
  them) with every ``[T]`` leaf padded to ``[t_pad]``."""
  return jax.tree.map(lambda x: x if x.shape == () else _pad_rows(
      x, t_pad, False if x.dtype == jnp.bool_ else 0), operands)


def _slice_tokens(operands, r0, tc: int):
  return jax.tree.map(lambda x: x if x.shape == () else lax.dynamic_slice_in_dim(x, r0, tc),
                      operands)


def run(hidden, weight, bias, temp, targets, mask, cotangents, token_operands, *,
        implementation: str, layout: str, compute_dtype, vocab_size: int, token_chunk: int,
        entropy_grad: bool, backend):
  """``(logp [T], entropy [T], dh [T, H] float32, dw float32 (the weight's shape), db
  float32 [V] or None)`` of the three-GEMM pass (see the module docstring).

  Args:
    hidden: ``[T, H]``, masked rows already zero; weight ``[H, V]`` / ``[V, H]``; bias
      ``[V]`` or None; temp: None (a static 1.0) or the float32 temperature; targets
      ``[T]`` int32; mask ``[T]`` bool or None.
    cotangents: ``(logp, entropy, operands, targets, active) -> (g_logp, g_ent)``, float32
      per token, 0 at inactive rows (the objective's per-token gradient, masked).
    token_operands: a pytree of ``[T]`` arrays and scalars, sliced per chunk.
    backend: the implementation's ``api.Backend`` record (logits, merge, dlogits).
  """
  t, h = hidden.shape
  hv = layout == "hv"
  v = vocab_size
  tc = token_chunk
  if tc % DW_TOKEN_BLOCK:
    raise ValueError(f"linear_objective: the token chunk ({tc}) must be a multiple of "
                     f"OBJECTIVE_DW_TOKEN_BLOCK={DW_TOKEN_BLOCK}")
  compute_dtype = jnp.dtype(compute_dtype)
  n_chunks = -(-t // tc)
  t_pad = n_chunks * tc
  active = jnp.ones((t,), bool) if mask is None else mask
  x = _pad_rows(hidden, t_pad)
  tg = _pad_rows(targets, t_pad)
  act = _pad_rows(active, t_pad, False)
  ops = _token_leaves(token_operands, t_pad)
  w = weight.astype(compute_dtype)
  t_arg = 1.0 if temp is None else temp
  inv_t = sp.temperature_operand(t_arg)
  inv_t = None if inv_t is None else inv_t[0]
  gemm = implementation
  dh_impl = gemm_backward.product_implementation(gemm, h, v, compute_dtype)
  db_impl = gemm_backward.product_implementation(gemm, v, DW_TOKEN_BLOCK, compute_dtype)
  # dW += h_b^T dz_b in the Mosaic GEMM's accumulate epilogue where it takes the shape
  # (bitwise the add below, with no product buffer).
  acc_in_epilogue = gemm_backend(gemm).epilogues and gemm_mosaic.supported_shape(
      h if hv else v, v if hv else h, DW_TOKEN_BLOCK,
      gemm_mosaic.default_config(h if hv else v, v if hv else h, DW_TOKEN_BLOCK),
      lhs_transposed=True, rhs_transposed=False) is None
  ones = jnp.ones((DW_TOKEN_BLOCK, 1), compute_dtype)

  def dw_block(dw, xb, dzb):
    lhs, rhs = (xb, dzb) if hv else (dzb, xb)
    if acc_in_epilogue:
      return gemm_mosaic.matmul(lhs, rhs, lhs_transposed=True, rhs_transposed=False,
                                out_dtype=jnp.float32, acc=dw)
    return dw + matmul2d(lhs, rhs, lhs_transposed=True, rhs_transposed=False,
                         out_dtype=jnp.float32, implementation=gemm)

  def chunk(c, carry):
    logp_all, ent_all, dh, dw, db = carry
    r0 = c * tc
    x_c = lax.dynamic_slice_in_dim(x, r0, tc)
    t_c = lax.dynamic_slice_in_dim(tg, r0, tc)
    a_c = lax.dynamic_slice_in_dim(act, r0, tc)
    # 1. The logits, once, with the fused op's statistics (its bits).
    z, (m, s, u) = backend.logits(x_c, weight, bias, layout=layout, temperature=t_arg,
                                  compute_dtype=compute_dtype, return_stats=True)
    lse, mean_z, ent = backend.merge_partials(m, s, u)
    tz = jnp.take_along_axis(z, jnp.clip(t_c, 0, v - 1)[:, None], axis=1)[:, 0]
    logp, ent = sp.finalize(tz, lse, ent, t_c, a_c, v)
    # 2. The objective's per-token cotangents (masked rows 0, bad active targets NaN).
    g_logp, g_ent = cotangents(logp, ent, _slice_tokens(ops, r0, tc), t_c, a_c)
    if not entropy_grad:
      g_ent = jnp.zeros_like(g_ent)
    # 3. dz from the stored logits, elementwise.
    dz = backend.dlogits(z, lse, mean_z, g_logp, g_ent, t_c, inv_temperature=inv_t,
                         entropy=entropy_grad).astype(compute_dtype)
    # 4. dH rows: one product over the whole vocabulary.
    dh_c = matmul2d(dz, w, lhs_transposed=False, rhs_transposed=hv, out_dtype=jnp.float32,
                    implementation=dh_impl)
    dh = lax.dynamic_update_slice(dh, dh_c, (r0, 0))
    # 5. dW (and db) in the contract's token blocks, ascending.
    for b0 in range(0, tc, DW_TOKEN_BLOCK):
      xb = lax.slice_in_dim(x_c, b0, b0 + DW_TOKEN_BLOCK).astype(compute_dtype)
      dzb = lax.slice_in_dim(dz, b0, b0 + DW_TOKEN_BLOCK)
      dw = dw_block(dw, xb, dzb)
      if db is not None:
        db = db + matmul2d(ones, dzb, lhs_transposed=True, rhs_transposed=False,
                           out_dtype=jnp.float32, implementation=db_impl)[0]
    logp_all = lax.dynamic_update_slice_in_dim(logp_all, logp, r0, 0)
    ent_all = lax.dynamic_update_slice_in_dim(ent_all, ent, r0, 0)
    return logp_all, ent_all, dh, dw, db

  zeros_t = jnp.zeros((t_pad,), jnp.float32)
  carry = (zeros_t, zeros_t, jnp.zeros((t_pad, h), jnp.float32),
           jnp.zeros(weight.shape, jnp.float32),
           None if bias is None else jnp.zeros((v,), jnp.float32))
  logp, ent, dh, dw, db = lax.fori_loop(0, n_chunks, chunk, carry)
  return logp[:t], ent[:t], dh[:t], dw, db


def dlogits(z, lse, mean_z, g_logp, g_ent, targets, *, inv_temperature, entropy: bool = True):
  """``dz = (g_logp (onehot - p) - g_ent p (z - mean_z)) / temperature`` of stored float32
  logits ``z [rows, V]`` (bias and temperature applied): the logit gradient of
  ``gemm_backward`` (``softmax_partials.logit_grad``), for the GPU implementations and the
  interpreter."""
  cols = lax.broadcasted_iota(jnp.int32, (1, z.shape[1]), 1)
  ok = jnp.ones((1, z.shape[1]), bool)
  onehot = (cols == targets[:, None]).astype(jnp.float32)
  return sp.logit_grad(z, lse[:, None], mean_z[:, None], onehot, g_logp[:, None],
                       g_ent[:, None] if entropy else None, ok, inv_temperature, mask_p=True)
