"""Argument validation shared by every public op.

Each function takes the op name and the argument name first, so that every message reads
``"{op}: {name} must ..., got ..."`` and names the argument the caller passed. Concrete
values are checked eagerly and exactly (ValueError/TypeError before any cast or kernel);
traced values are checked with ``checkify.debug_check``, which is free under plain ``jit``
and raises when the caller wraps the function in ``jax.experimental.checkify.checkify``.

Bad input never gives a silent wrong answer: a value that would be cast (an id that does
not fit int32, a mask value that is neither 0 nor 1, a float given as a flag) is an error,
not a conversion.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

_INT32_MIN = int(np.iinfo(np.int32).min)
_INT32_MAX = int(np.iinfo(np.int32).max)

FLOAT_DTYPES = ("bfloat16", "float16", "float32")


def dtype_kind(dtype: Any) -> str:
  """numpy's kind letter ("b", "i", "u", "f", "c", ...), with "f" for ml_dtypes floats.

  ``np.dtype(jnp.bfloat16).kind`` is "V"; every float check here goes through this.
  """
  dt = np.dtype(dtype)
  if dt.kind == "V" and jnp.issubdtype(dt, jnp.floating):
    return "f"
  return dt.kind


def _is_tracer(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def is_concrete(*xs: Any) -> bool:
  """True when no non-None argument is a tracer (so its values can be read on the host)."""
  return not any(_is_tracer(x) for x in xs if x is not None)


def _first_index(bad: np.ndarray) -> tuple[int, ...]:
  return tuple(int(i) for i in np.argwhere(bad)[0])


def _fmt_index(idx: tuple[int, ...]) -> str:
  return str(idx[0]) if len(idx) == 1 else str(idx)


def check_bool(op: str, name: str, value: Any) -> bool:
  """Returns ``value`` as a Python bool; only ``bool`` and ``np.bool_`` are accepted.

  ``1``, ``1.0`` and ``np.array(True)`` are TypeErrors: a flag given as a number is
  usually a positional argument in the wrong place.
  """
  if isinstance(value, bool | np.bool_):
    return bool(value)
  raise TypeError(f"{op}: {name} must be a Python bool, got {value!r} "
                  f"({type(value).__name__})")


def check_choice(op: str, name: str, value: Any, choices: Sequence[str]) -> str:
  """Returns ``value`` if it is one of the strings ``choices``, else a ValueError listing them."""
  if isinstance(value, str) and value in choices:
    return value
  raise ValueError(f"{op}: {name} must be one of {tuple(choices)}, got {value!r}")


def _as_array_like(op: str, name: str, x: Any) -> Any:
  """Tracers and jax arrays pass through; lists, tuples and scalars become numpy arrays."""
  if _is_tracer(x) or isinstance(x, jax.Array | np.ndarray):
    return x
  if isinstance(x, str | bytes) or x is None:
    raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
  try:
    arr = np.asarray(x)
  except (TypeError, ValueError) as e:  # ragged nested lists and the like
    raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__} "
                    f"that numpy cannot convert ({e})") from None
  # Python ints beyond int64 give an object array; as_ids reports them with their value.
  return arr


def _check_shape(op: str, name: str, x: Any, shape: Sequence[int] | None) -> None:
  if shape is not None and tuple(x.shape) != tuple(shape):
    raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def as_mask(op: str, name: str, mask: Any, shape: Sequence[int] | None) -> jax.Array | None:
  """Returns ``mask`` as a bool array of ``shape`` (``None`` passes through as ``None``).

  Accepts lists, numpy and jax arrays of dtype bool, or integer/float dtype holding exactly
  0 and 1. A concrete value other than 0/1 (2, 0.5, NaN) is a ValueError naming its first
  index: such a value is a weight, not a mask, and treating it as ``!= 0`` would silently
  change the loss. A traced non-bool mask is checked with ``checkify.debug_check`` and
  converted with ``!= 0``. ``shape=None`` skips the shape check.
  """
  if mask is None:
    return None
  m = _as_array_like(op, name, mask)
  if isinstance(mask, list | tuple) and m.size == 0:
    # numpy types an empty list float64 and cannot spell shape (0, T) as a list.
    m = m.astype(bool).reshape(m.shape if shape is None or math.prod(shape) else shape)
  kind = dtype_kind(m.dtype)
  if kind not in "biuf":
    raise TypeError(f"{op}: {name} must have a bool, integer or float dtype, got {m.dtype}")
  _check_shape(op, name, m, shape)
  if kind == "b":
    return m if isinstance(m, jax.Array) else jnp.asarray(m)
  if _is_tracer(m):
    ok = jnp.all((m == 0) | (m == 1))
    checkify.debug_check(ok, f"{op}: {name} must hold only 0 and 1 (or be bool)")
    return m != 0
  host = np.asarray(m)
  bad = ~((host == 0) | (host == 1))
  if bad.any():
    idx = _first_index(bad)
    raise ValueError(f"{op}: {name} must be bool or hold only 0 and 1, got {host[idx].item()!r} "
                     f"at index {_fmt_index(idx)}")
  # Compare in jax for jax inputs so that a sharded mask stays sharded.
  return m != 0 if isinstance(m, jax.Array) else jnp.asarray(host != 0)


def _object_ids(op: str, name: str, arr: np.ndarray) -> np.ndarray:
  """Python ints too large for int64 (object arrays): report the first that misses int32."""
  flat = arr.reshape(-1)
  for i, v in enumerate(flat):
    if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Integral):
      raise TypeError(f"{op}: {name} must hold integer ids, got {v!r} "
                      f"({type(v).__name__})")
    if not _INT32_MIN <= int(v) <= _INT32_MAX:
      idx = np.unravel_index(i, arr.shape)
      raise ValueError(f"{op}: {name} must fit int32, got {int(v)} at index "
                       f"{_fmt_index(tuple(int(j) for j in idx))}")
  return arr.astype(np.int32)


def as_ids(op: str, name: str, ids: Any, *, shape: Sequence[int] | None = None) -> jax.Array:
  """Returns token ids as an int32 array.

  Accepts lists, numpy and jax integer arrays. Float and bool dtypes are TypeErrors (an id
  of 3.7 has no meaning). Concrete values outside int32 are a ValueError naming the first
  such index and its true value, checked BEFORE the cast (a cast would wrap 2**32 + 5 to
  5). Traced ids of a wider integer dtype are checked with ``checkify.debug_check``.
  """
  x = _as_array_like(op, name, ids)
  if isinstance(ids, list | tuple) and x.size == 0:
    # numpy types an empty list float64 and cannot spell shape (0, T) as a list.
    x = x.astype(np.int32).reshape(x.shape if shape is None or math.prod(shape) else shape)
  if isinstance(x, np.ndarray) and x.dtype == object:
    _check_shape(op, name, x, shape)
    return jnp.asarray(_object_ids(op, name, x))
  kind = dtype_kind(x.dtype)
  if kind not in "iu":
    raise TypeError(f"{op}: {name} must have an integer dtype, got {x.dtype}")
  _check_shape(op, name, x, shape)
  if x.dtype == np.int32:
    return x if isinstance(x, jax.Array) else jnp.asarray(x)
  if _is_tracer(x):
    if np.dtype(x.dtype).itemsize >= 4:
      lo = jnp.asarray(_INT32_MIN, x.dtype) if kind == "i" else jnp.asarray(0, x.dtype)
      fits = jnp.all((x >= lo) & (x <= jnp.asarray(_INT32_MAX, x.dtype)))
      checkify.debug_check(fits, f"{op}: {name} must fit int32")
    return x.astype(jnp.int32)
  host = np.asarray(x)
  if host.size:
    wide = host.astype(np.int64) if kind == "i" else host.astype(np.uint64)
    bad = (wide > _INT32_MAX) if kind == "u" else (wide < _INT32_MIN) | (wide > _INT32_MAX)
    if bad.any():
      idx = _first_index(bad)
      raise ValueError(f"{op}: {name} must fit int32, got {int(host[idx])} at index "
                       f"{_fmt_index(idx)}")
  return x.astype(jnp.int32) if isinstance(x, jax.Array) else jnp.asarray(host.astype(np.int32))


def check_ids_in_range(op: str, name: str, ids: Any, vocab_size: int,
                       mask: Any = None) -> None:
  """Checks that every id where ``mask`` is True (every id without a mask) is in [0, V).

  Concrete: ValueError with the count, the first bad index and its value. Traced:
  ``checkify.debug_check`` (run under ``checkify.checkify`` to get the error out of ``jit``).
  Positions where ``mask`` is False are ignored (their ids may be anything, e.g. -100).
  """
  vocab_size = check_int(op, "vocab_size", vocab_size, minimum=1)
  if is_concrete(ids, mask):
    t = np.asarray(ids)
    bad = (t < 0) | (t >= vocab_size)
    if mask is not None:
      bad &= np.asarray(mask).astype(bool)
    if bad.any():
      idx = _first_index(bad)
      raise ValueError(f"{op}: {name} must lie in [0, {vocab_size}), got {int(t[idx])} at "
                       f"index {_fmt_index(idx)} ({int(bad.sum())} id(s) out of range)")
    return
  t = jnp.asarray(ids)
  bad = (t < 0) | (t >= vocab_size)
  if mask is not None:
    bad = bad & jnp.asarray(mask).astype(bool)
  checkify.debug_check(~jnp.any(bad), f"{op}: {{n}} {name} id(s) outside [0, {vocab_size})",
                       n=jnp.sum(bad))


def as_float_dtype(op: str, name: str, dtype: Any,
                   allowed: Sequence[str] = FLOAT_DTYPES) -> jnp.dtype:
  """Returns ``jnp.dtype(dtype)`` if it names one of ``allowed``, else a TypeError naming it.

  Junk (``"nonsense"``, ``None``, ``True``) gets this module's message, never numpy's.
  """
  if dtype is None or isinstance(dtype, bool | np.bool_):
    raise TypeError(f"{op}: {name} must be one of {tuple(allowed)}, got {dtype!r}")
  try:
    dt = jnp.dtype(dtype)
  except (TypeError, ValueError):
    raise TypeError(f"{op}: {name} must be one of {tuple(allowed)}, got {dtype!r}") from None
  if dt.name not in allowed:
    raise TypeError(f"{op}: {name} must be one of {tuple(allowed)}, got {dt.name}")
  return dt


def check_float_array(op: str, name: str, x: Any, allowed: Sequence[str] = FLOAT_DTYPES) -> None:
  """Checks that ``x`` is an array (jax, numpy or tracer) whose dtype is one of ``allowed``."""
  dtype = getattr(x, "dtype", None)
  if dtype is None or not hasattr(x, "shape"):
    raise TypeError(f"{op}: {name} must be a jax or numpy array, got {type(x).__name__}")
  if np.dtype(dtype).name not in allowed:
    raise TypeError(f"{op}: {name} must have dtype in {tuple(allowed)}, got {dtype}")


def as_scalar(op: str, name: str, value: Any, *, positive: bool = False,
              allow_traced: bool = True) -> float | jax.Array:
  """Returns a real scalar: a Python float when concrete, a float32 0-d array when traced.

  Rejects bools (``True`` is not 1.0 here), strings, complex numbers and arrays whose shape
  is not ``()``. Concrete values must be finite (and > 0 when ``positive``). Traced values
  are accepted only with ``allow_traced`` (their range is then the caller's business, or a
  ``checkify.debug_check``); otherwise TypeError "must be a concrete number".
  """
  if isinstance(value, bool | np.bool_ | str | bytes) or value is None:
    raise TypeError(f"{op}: {name} must be a real number, got {value!r} "
                    f"({type(value).__name__})")
  if _is_tracer(value) or isinstance(value, jax.Array | np.ndarray | np.generic):
    shape = tuple(value.shape)
    kind = dtype_kind(value.dtype)
    if shape != ():
      raise TypeError(f"{op}: {name} must be a scalar, got an array of shape {shape}")
    if kind not in "iuf":
      raise TypeError(f"{op}: {name} must be a real number, got dtype {value.dtype}")
    if _is_tracer(value):
      if not allow_traced:
        raise TypeError(f"{op}: {name} must be a concrete number, got a traced value "
                        f"(pass it as a Python float or mark it static)")
      v = value.astype(jnp.float32)
      if positive:
        checkify.debug_check(v > 0, f"{op}: {name} must be > 0")
      return v
    value = np.asarray(value).item()
  if not isinstance(value, numbers.Real):
    raise TypeError(f"{op}: {name} must be a real number, got {value!r} "
                    f"({type(value).__name__})")
  v = float(value)
  if not math.isfinite(v):
    raise ValueError(f"{op}: {name} must be finite, got {v}")
  if positive and not v > 0:
    raise ValueError(f"{op}: {name} must be > 0, got {v}")
  return v


def as_temperature(op: str, value: Any, *, name: str = "temperature"
                   ) -> float | jax.Array:
  """A sampling/scoring temperature: :func:`as_scalar` with ``positive``, and a concrete
  value's reciprocal must be finite in float32 (the dtype temperatures are applied in), so
  ``1e-42`` is refused rather than turned into inf/NaN log-probs."""
  t = as_scalar(op, name, value, positive=True)
  if not isinstance(t, jax.Array):
    f32_max = float(np.finfo(np.float32).max)
    if not 1.0 / f32_max <= t <= f32_max:
      raise ValueError(f"{op}: {name} must lie in [{1.0 / f32_max:.4g}, {f32_max:.4g}] (it and "
                       f"its reciprocal must be finite in float32), got {t!r}")
  return t


def check_int(op: str, name: str, value: Any, *, minimum: int | None = None) -> int:
  """Returns a Python/numpy integer as ``int``; floats, bools and arrays are TypeErrors."""
  if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
    raise TypeError(f"{op}: {name} must be an integer, got {value!r} "
                    f"({type(value).__name__})")
  v = int(value)
  if minimum is not None and v < minimum:
    raise ValueError(f"{op}: {name} must be >= {minimum}, got {v}")
  return v


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def no_gradient(op: str, what: str, x: jax.Array) -> jax.Array:
  """``x`` unchanged; differentiating through it raises a TypeError naming ``op``.

  For sampler-side values whose derivative would otherwise be silently wrong (a
  ``stop_gradient`` gives zeros, a partial chain gives part of it). Differentiating
  something else (``x`` constant to the derivative) is fine."""
  return x


@no_gradient.defjvp
def _no_gradient_jvp(op, what, primals, tangents):
  raise TypeError(f"{op}: {what} has no gradient (a sampler-side function); differentiate "
                  "linear_logp or head_logits(return_stats=False) instead")


_F = TypeVar("_F", bound=Callable[..., Any])


def keyword_mask(fn: _F) -> _F:
  """``fn`` with a positional ``mask`` (or any argument after its positional ones) refused
  by a TypeError naming the keyword-only arguments, instead of Python's bare message."""
  params = inspect.signature(fn).parameters.values()
  positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    if len(args) > len(positional):
      raise TypeError(
          f"{fn.__name__}: takes {len(positional)} positional arguments "
          f"({', '.join(positional)}) but {len(args)} were given; mask and every option "
          f"after it are keyword-only: {fn.__name__}({', '.join(positional)}, mask=mask, ...)")
    return fn(*args, **kwargs)

  return wrapper  # type: ignore[return-value]
