"""Float64 reference of the grouped GEMM (the truth tests and benchmarks compare against)."""

from __future__ import annotations

import numpy as np


def grouped_matmul_reference(x, w, expert_ids) -> np.ndarray:
  """``out[a] = x[a] @ w[expert_ids[a]]`` in float64: ``x [A, K]``, ``w [E, K, N]``."""
  x64 = np.asarray(x, np.float64)
  w64 = np.asarray(w, np.float64)
  ids = np.asarray(expert_ids)
  return np.einsum("ak,akn->an", x64, w64[ids])


def grouped_matmul_grads_reference(x, w, expert_ids, g):
  """Float64 ``(dx, dw)`` of ``sum(g * grouped_matmul_reference(x, w, expert_ids))``."""
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  g64, ids = np.asarray(g, np.float64), np.asarray(expert_ids)
  dx = np.einsum("an,akn->ak", g64, w64[ids])
  dw = np.zeros_like(w64)
  np.add.at(dw, ids, np.einsum("ak,an->akn", x64, g64))
  return dx, dw
