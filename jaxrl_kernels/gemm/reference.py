"""Float64 reference for ``det_matmul`` (the truth tests and benchmarks compare against)."""

from __future__ import annotations

import numpy as np


def matmul_reference(a, b, *, transpose_b: bool = False) -> np.ndarray:
  """``a @ b`` in float64 on the host; ``b`` is ``[N, K]`` when ``transpose_b``."""
  a64 = np.asarray(a, dtype=np.float64)
  b64 = np.asarray(b, dtype=np.float64)
  if transpose_b:
    b64 = b64.T
  return a64 @ b64


def matmul_grads_reference(a, b, g, *, transpose_b: bool = False):
  """Float64 ``(dA, dB)`` of ``sum(g * (a @ b))``."""
  a64 = np.asarray(a, np.float64).reshape(-1, np.shape(a)[-1])
  b64 = np.asarray(b, np.float64)
  g64 = np.asarray(g, np.float64).reshape(a64.shape[0], -1)
  bkn = b64.T if transpose_b else b64
  da = (g64 @ bkn.T).reshape(np.shape(a))
  db = a64.T @ g64
  return da, (db.T if transpose_b else db)
