"""Rotary position embedding (``transformers``' rotate-half form): one definition for every
model of the package (``models.DecoderLM`` and ``nn.TinyCausalLM``), elementwise from the
integer position, so a token's bits do not depend on where it is computed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels._cpu import guard, opaque_zero


def rope_frequencies(theta: float, head_dim: int) -> np.ndarray:
  """float32 ``[head_dim / 2]`` frequencies ``1 / theta ** (arange(0, d, 2) / d)``, computed
  in float32 as ``transformers`` does (before any ``rope_scaling``)."""
  if head_dim <= 0 or head_dim % 2:
    raise ValueError(f"rope_frequencies: head_dim must be a positive even int, got {head_dim!r}")
  exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  return (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, *,
         guarded: bool = True) -> jax.Array:
  """``transformers``' rotary embedding of ``x [B, T, heads, d]`` at ``positions [B, T]``.

  ``angle = position * inv_freq`` in float32, ``x cos + rotate_half(x) sin``
  (``rotate_half([x1, x2]) = [-x2, x1]``) in float32 with one rounding to
  ``x``'s dtype at the end (``transformers`` rounds ``cos``/``sin`` and each
  product to the activation dtype; one rounding keeps the bits independent of
  XLA's fusion, see :class:`jaxrl_kernels.nn.norm.RMSNorm`). Elementwise: the same bits for a token
  wherever it is computed. ``guarded`` keeps the two products out of their sum's
  FMA (``_cpu.guard``; the stock path passes False).
  """
  ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  emb = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  a, b = x32 * jnp.cos(emb), rotated * jnp.sin(emb)
  if guarded:
    zero = opaque_zero(x32)
    a, b = guard(a, zero), guard(b, zero)
  return (a + b).astype(x.dtype)
