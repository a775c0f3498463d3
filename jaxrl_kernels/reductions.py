"""Global masked reductions: sums, counts and means whose denominator is global.

A loss averaged over tokens must not depend on how those tokens are split across
devices (data / tensor / sequence parallel mesh axes) or micro-batches. The only
way to get that is a *global* denominator:

    mean = (Σ_devices Σ_tokens m·v) / (Σ_devices Σ_tokens m)

and never the average of per-device means ``(1/D) Σ_d mean_d``, which weights a
device's tokens by ``1 / (its token count)`` and so changes with the split.

Inside ``shard_map`` pass the mesh axes the tokens are split over as
``axis_names``; the local partial sums are then ``psum``-ed over them. Outside
``shard_map`` leave ``axis_names=()`` (under ``jit`` with sharded inputs XLA already
reduces globally).

Numerics (see docs/rl.md):

* The reduction state is float32 (float64 under ``jax_enable_x64`` for float64
  inputs): bf16/fp16 values are upcast before summing.
* ``masked_count`` of a boolean mask is counted in int32 and converted to float32
  once, so it is exact (below 2**24) and **bitwise** invariant to any split.
* ``masked_sum`` / ``masked_mean`` are invariant to the split up to float32
  rounding only (``psum`` and the local sums re-associate the additions); they
  are *not* bitwise invariant.
* Masked-out positions contribute exactly zero even if they hold NaN/inf (the
  values are selected with ``where``, not multiplied by the mask), and receive
  zero gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

Axis = int | Sequence[int] | None
AxisNames = str | Sequence[str]


def _axis_names(axis_names: AxisNames) -> tuple[str, ...]:
  if isinstance(axis_names, str):
    return (axis_names,)
  return tuple(axis_names)


def _state_dtype(dtype) -> jnp.dtype:
  """float32 reduction state; float64 stays float64 (only under x64)."""
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.promote_types(dtype, jnp.float32)
  return jnp.dtype(jnp.float32)


def _psum(x: jax.Array, axis_names: AxisNames) -> jax.Array:
  names = _axis_names(axis_names)
  return lax.psum(x, names) if names else x


def _check_mask(fn: str, values: jax.Array, mask: jax.Array) -> jax.Array:
  try:
    shape = jnp.broadcast_shapes(jnp.shape(values), jnp.shape(mask))
  except ValueError:
    raise ValueError(f"{fn}: mask of shape {jnp.shape(mask)} does not broadcast to values of "
                     f"shape {jnp.shape(values)}") from None
  if shape != jnp.shape(values):
    raise ValueError(f"{fn}: mask of shape {jnp.shape(mask)} must broadcast to values of shape "
                     f"{jnp.shape(values)}, not enlarge it to {shape}")
  return jnp.broadcast_to(mask, shape)


def masked_sum(values: jax.Array, mask: jax.Array, *, axis: Axis = None,
               axis_names: AxisNames = ()) -> jax.Array:
  r"""Masked sum with float32 state, summed over the named mesh axes.

  .. math::  S = \sum_{d \in \text{axis\_names}} \sum_{i \in \text{axis}} m_{d,i}\, v_{d,i}

  Args:
    values: ``[...]`` any real dtype; upcast to float32 before summing.
    mask: bool (selects) or numeric (weights ``m``), broadcastable to ``values``.
      Positions with ``m == 0`` contribute exactly 0 even when ``values`` is NaN.
    axis: local axes to sum over (``None``: all).
    axis_names: mesh axes (inside ``shard_map``) whose devices hold other parts
      of the same sum; the local sums are ``psum``-ed over them.

  Returns:
    float32 array: ``values`` reduced over ``axis``.

  >>> masked_sum(jnp.array([1., 2., jnp.nan]), jnp.array([True, True, False]))
  Array(3., dtype=float32)
  """
  values = jnp.asarray(values)
  mask = _check_mask("masked_sum", values, jnp.asarray(mask))
  v = values.astype(_state_dtype(values.dtype))
  if mask.dtype == jnp.bool_:
    terms = jnp.where(mask, v, jnp.zeros((), v.dtype))
  else:
    w = mask.astype(v.dtype)
    terms = jnp.where(w != 0, v * w, jnp.zeros((), v.dtype))
  return _psum(jnp.sum(terms, axis=axis), axis_names)


def masked_count(mask: jax.Array, *, axis: Axis = None, axis_names: AxisNames = ()) -> jax.Array:
  r"""Number (or total weight) of active positions, summed over the named mesh axes.

  .. math::  N = \sum_{d \in \text{axis\_names}} \sum_{i \in \text{axis}} m_{d,i}

  A boolean (or integer) mask is counted in int32 (exact, bitwise invariant to
  how positions are split across devices) and returned as float32; a floating
  mask is summed as float32 weights.

  Args:
    mask: ``[...]`` bool or numeric.
    axis: local axes to count over (``None``: all).
    axis_names: mesh axes (inside ``shard_map``) to sum the count over.

  Returns:
    float32 array: ``mask`` reduced over ``axis``.
  """
  mask = jnp.asarray(mask)
  if mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer):
    count = _psum(jnp.sum(mask.astype(jnp.int32), axis=axis), axis_names)
    return count.astype(jnp.float32)
  return _psum(jnp.sum(mask.astype(_state_dtype(mask.dtype)), axis=axis), axis_names)


def masked_mean(values: jax.Array, mask: jax.Array, *, axis: Axis = None,
                axis_names: AxisNames = (), eps: float = 1e-6) -> jax.Array:
  r"""Masked mean with a global denominator over the named mesh axes.

  .. math::  \bar v = \frac{\sum_{d,i} m_{d,i} v_{d,i}}{\max(\sum_{d,i} m_{d,i},\ \epsilon)}

  with both sums taken over ``axis`` locally and over ``axis_names`` across
  devices, so the result does not depend on how positions are split (up to
  float32 rounding of the numerator). With nothing active the result is 0, never
  NaN: the numerator is then exactly 0 and the denominator ``eps``.

  Args:
    values: ``[...]`` any real dtype; upcast to float32.
    mask: bool or numeric weights, broadcastable to ``values``.
    axis: local axes to average over (``None``: all).
    axis_names: mesh axes (inside ``shard_map``) over which positions are split.
    eps: lower bound of the denominator (> 0). A count is either 0 or >= 1 for
      a boolean mask, so ``eps <= 1`` never biases a non-empty mean.

  Returns:
    float32 array: ``values`` averaged over ``axis``.

  >>> masked_mean(jnp.array([1., 3., 100.]), jnp.array([True, True, False]))
  Array(2., dtype=float32)
  """
  if not eps > 0:
    raise ValueError(f"masked_mean: eps must be > 0, got {eps}")
  values = jnp.asarray(values)
  mask = _check_mask("masked_mean", values, jnp.asarray(mask))
  total = masked_sum(values, mask, axis=axis, axis_names=axis_names)
  count = masked_count(mask, axis=axis, axis_names=axis_names).astype(total.dtype)
  return total / jnp.maximum(count, jnp.asarray(eps, total.dtype))
