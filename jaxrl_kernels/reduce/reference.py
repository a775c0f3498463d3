"""float64 truth for the fixed-order reductions (tests and benchmarks compare against it)."""

from __future__ import annotations

import numpy as np


def sum_ref(x, axis=None) -> np.ndarray:
  """``sum(x, axis)`` in float64 on the host."""
  return np.sum(np.asarray(x, np.float64), axis=axis)


def cumsum_ref(x, axis: int = -1, reverse: bool = False) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if reverse:
    return np.flip(np.cumsum(np.flip(x, axis), axis), axis)
  return np.cumsum(x, axis)


def cumlogsumexp_ref(x, axis: int = -1, reverse: bool = False) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if reverse:
    x = np.flip(x, axis)
  out = np.logaddexp.accumulate(x, axis=axis)
  return np.flip(out, axis) if reverse else out


def cumprod_ref(x, axis: int = -1, reverse: bool = False) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if reverse:
    return np.flip(np.cumprod(np.flip(x, axis), axis), axis)
  return np.cumprod(x, axis)
