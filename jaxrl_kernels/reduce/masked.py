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
  exactly zero gradient, also with respect to numeric mask weights.
* Masks: bool selects; integer or float masks are weights (``0`` drops a position,
  ``2`` counts it twice). Complex, string or object masks are a TypeError.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_kernels import _validation as val

Axis = int | Sequence[int] | None
AxisNames = str | Sequence[str]


def as_axis_names(axis_names: AxisNames) -> tuple[str, ...]:
  """``"data"`` or ``("data", "fsdp")`` (mesh axis names) as a tuple of names."""
  if isinstance(axis_names, str):
    return (axis_names,)
  try:
    names = tuple(axis_names)
  except TypeError:
    raise TypeError(f"axis_names must be a mesh axis name or a sequence of them, got "
                    f"{axis_names!r}") from None
  if not all(isinstance(n, str) for n in names):
    raise TypeError(f"axis_names must be a mesh axis name or a sequence of them, got "
                    f"{axis_names!r}")
  return names


def _state_dtype(dtype) -> jnp.dtype:
  """float32 reduction state; float64 stays float64 (only under x64)."""
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.promote_types(dtype, jnp.float32)
  return jnp.dtype(jnp.float32)


def _psum(x: jax.Array, axis_names: AxisNames) -> jax.Array:
  names = as_axis_names(axis_names)
  return lax.psum(x, names) if names else x


def _array(fn: str, name: str, x, kinds: str) -> jax.Array:
  """Lists, numpy and jax arrays of a real (or bool) dtype as a jax array."""
  if not isinstance(x, jax.Array | np.ndarray | jax.core.Tracer):
    try:
      x = np.asarray(x)
    except (TypeError, ValueError):
      raise TypeError(f"{fn}: {name} must be an array, got {type(x).__name__}") from None
  if val.dtype_kind(x.dtype) not in kinds:
    raise TypeError(f"{fn}: {name} must have a {'bool, ' if 'b' in kinds else ''}integer or "
                    f"float dtype, got {x.dtype}")
  return jnp.asarray(x)


def _check_axis(fn: str, axis: Axis, ndim: int) -> None:
  axes = () if axis is None else (axis,) if isinstance(axis, int | np.integer) else axis
  try:
    axes = tuple(axes)
  except TypeError:
    raise TypeError(f"{fn}: axis must be None, an int or a sequence of ints, got "
                    f"{axis!r}") from None
  for a in axes:
    if isinstance(a, bool | np.bool_) or not isinstance(a, int | np.integer):
      raise TypeError(f"{fn}: axis must be None, an int or a sequence of ints, got {axis!r}")
    if not -ndim <= a < ndim:
      raise ValueError(f"{fn}: axis {a} is out of range for values of rank {ndim}")


def _check_mask(fn: str, values: jax.Array, mask) -> jax.Array:
  mask = _array(fn, "mask", mask, "biuf")
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
  values = _array("masked_sum", "values", values, "biuf")
  mask = _check_mask("masked_sum", values, mask)
  _check_axis("masked_sum", axis, values.ndim)
  v = values.astype(_state_dtype(values.dtype))
  zero = jnp.zeros((), v.dtype)
  if mask.dtype == jnp.bool_:
    terms = jnp.where(mask, v, zero)
  else:
    # Select before multiplying: 0 * NaN would leak into the sum and into d/dw.
    w = mask.astype(v.dtype)
    keep = w != 0
    terms = jnp.where(keep, v, zero) * jnp.where(keep, w, zero)
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
  mask = _array("masked_count", "mask", mask, "biuf")
  _check_axis("masked_count", axis, mask.ndim)
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
  eps = val.as_scalar("masked_mean", "eps", eps, positive=True)
  values = _array("masked_mean", "values", values, "biuf")
  mask = _check_mask("masked_mean", values, mask)
  total = masked_sum(values, mask, axis=axis, axis_names=axis_names)
  count = masked_count(mask, axis=axis, axis_names=axis_names).astype(total.dtype)
  return total / jnp.maximum(count, jnp.asarray(eps, total.dtype))
