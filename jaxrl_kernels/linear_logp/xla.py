"""The ``"xla"`` implementation of ``linear_logp``: materialized logits, XLA's reductions.

``z = (h W + b) / temperature`` as one ``[T, V]`` float32 array, then
``logsumexp`` / softmax and a gather; differentiated by JAX. The benchmark
baseline and the control of the invariance tests: **not** batch-invariant
(XLA's dot and reductions may change their order with the shape).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels.pallas import softmax_partials as sp


def logits(hidden2d, weight, bias, *, layout: str, temperature, compute_dtype):
  """The stock ``[T, V]`` float32 logits (plain ``jnp.dot``; fp32 at HIGHEST precision)."""
  w = weight.T if layout == "vh" else weight
  z = jnp.dot(hidden2d.astype(compute_dtype), w.astype(compute_dtype),
              preferred_element_type=jnp.float32,
              precision=jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None)
  bias_row = None if bias is None else bias.astype(jnp.float32)
  inv = sp.temperature_operand(temperature)
  return sp.scale_logits(z, bias_row, None if inv is None else inv[0])


def logits_stats(z):
  """``(lse, entropy)`` of materialized logits ``z [T, V]``."""
  lse, _, ent = sp.lse_entropy_xla(z)
  return lse, ent


def linear_logp(hidden2d, weight, bias, targets, mask, *, layout: str, temperature,
                compute_dtype):
  """``(logp, entropy)`` ``[T]`` float32 through materialized logits (JAX autodiff)."""
  if mask is not None:
    # Masked rows never reach an output or a gradient, whatever they hold.
    hidden2d = jnp.where(mask[:, None], hidden2d, jnp.zeros((), hidden2d.dtype))
  z = logits(hidden2d, weight, bias, layout=layout, temperature=temperature,
             compute_dtype=compute_dtype)
  v = z.shape[-1]
  lse, _, ent = sp.lse_entropy_xla(z)
  tz = jnp.take_along_axis(z, jnp.clip(targets, 0, v - 1)[:, None], axis=-1)[:, 0]
  return sp.finalize(tz, lse, ent, targets, mask, v)
