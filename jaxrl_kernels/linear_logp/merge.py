"""The building blocks shared by ``linear_logp`` and its vocab-parallel (TP) form.

A vocab shard computes its per-tile partials with :func:`tile_partials`; the
partials of all shards, concatenated along the tile axis in global tile
order, go through the one :func:`merge_partials`, and :func:`finalize` turns
``(target_logit, lse, entropy)`` into the outputs. Because the merge folds
tiles in ascending global order and every tile is computed the same way
whichever shard holds it, the result is bitwise the unsharded one whenever
shard boundaries fall on multiples of :data:`VOCAB_TILE`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels import _backend
from jaxrl_kernels.pallas import linear_logp_fwd as _fwd
from jaxrl_kernels.pallas.linear_logp_fwd import VOCAB_TILE as VOCAB_TILE

# The kernel implementations of the partials and the merge.
_IMPLEMENTATIONS = ("mosaic", "triton", "interpret")


def tile_partials(hidden2d: jax.Array, weight: jax.Array, bias: jax.Array | None,
                  targets: jax.Array, *, weight_layout: str = "hv", temperature: float = 1.0,
                  compute_dtype=None, implementation: str | None = None, vocab_offset: int = 0,
                  valid_vocab: int | None = None):
  """Per-vocab-tile float32 partials of ``z = (hidden2d @ W + b) / temperature``.

  Args:
    hidden2d: ``[T, H]``.
    weight: this shard's ``[H, V_s]`` (``"hv"``) or ``[V_s, H]`` (``"vh"``),
      holding global vocab ids ``[vocab_offset, vocab_offset + V_s)``.
    bias: ``[V_s]`` or None.
    targets: ``[T]`` int32 *global* ids.
    compute_dtype: product dtype (default: ``weight.dtype``; float32 for an
      fp32 head). Accumulation is float32.
    implementation: ``"mosaic"`` (Hopper, bf16/fp16 products: TMA + wgmma,
      :mod:`jaxrl_kernels.pallas.linear_logp_mosaic`), ``"triton"``,
      ``"interpret"``, or None (by device, as ``linear_logp`` picks). Each
      gives its own bits; within one, the contract holds.
    vocab_offset: a multiple of ``VOCAB_TILE`` for bitwise TP invariance.
    valid_vocab: local columns ``>= valid_vocab`` are padding (masked to -inf).

  Returns:
    ``(m, s, u, target_logit)``: ``[ceil(V_s / VOCAB_TILE), T]`` float32 tile
    max, ``sum exp(z - m)`` and ``sum exp(z - m) (z - m)``; ``[T]`` float32
    target logit, exactly 0 on rows whose target this shard does not own (so
    a sum over shards is exact).
  """
  compute_dtype = compute_dtype or weight.dtype
  if implementation is None:
    # As linear_logp picks for implementation=None.
    implementation = _backend.resolve("tile_partials", None, compute_dtype,
                                      supported=("mosaic", "triton", "interpret"))
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"tile_partials: implementation must be one of {_IMPLEMENTATIONS}, got "
                     f"{implementation!r}")
  if implementation == "mosaic":
    from jaxrl_kernels.pallas import linear_logp_mosaic

    return linear_logp_mosaic.tile_partials(
        hidden2d, weight, bias, targets, layout=weight_layout, temperature=temperature,
        compute_dtype=compute_dtype, vocab_offset=vocab_offset, valid_vocab=valid_vocab)
  return _fwd.tile_partials(
      hidden2d, weight, bias, targets, layout=weight_layout, temperature=temperature,
      compute_dtype=compute_dtype, interpret=implementation == "interpret",
      vocab_offset=vocab_offset, valid_vocab=valid_vocab)


def merge_partials(m: jax.Array, s: jax.Array, u: jax.Array, *,
                   implementation: str | None = None):
  """Folds ``[n_tiles, T]`` partials in ascending tile order (a Pallas kernel; the
  Triton one for ``"mosaic"`` too: the merge is O(tiles x T) and memory-bound).

  Returns float32 ``(lse, mean_z, entropy)``, each ``[T]``, with
  ``lse = logsumexp(z)``, ``mean_z = sum softmax(z) z``, ``entropy = lse - mean_z``.
  """
  if implementation is None:  # float32 partials: Triton on GPU, the interpreter on CPU
    implementation = _backend.resolve("merge_partials", None, jnp.float32,
                                      supported=_IMPLEMENTATIONS)
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"merge_partials: implementation must be one of {_IMPLEMENTATIONS}, got "
                     f"{implementation!r}")
  return _fwd.merge_partials(m, s, u, interpret=implementation == "interpret")


def finalize(target_logit: jax.Array, lse: jax.Array, entropy: jax.Array, targets: jax.Array,
             mask: jax.Array | None, vocab_size: int):
  """``logp = z[t] - lse``, NaN where an active target is outside ``[0, V)``,
  and 0 (both outputs) at masked positions. Elementwise: batch-invariant."""
  valid = (targets >= 0) & (targets < vocab_size)
  logp = jnp.where(valid, target_logit - lse, jnp.nan)
  if mask is not None:
    logp = jnp.where(mask, logp, 0.0)
    entropy = jnp.where(mask, entropy, 0.0)
  return logp, entropy
