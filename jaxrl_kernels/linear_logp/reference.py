"""The float64 truth of ``linear_logp`` (NumPy, on the host), for tests and benchmarks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _f64(x):
  return None if x is None else np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def linear_logp_reference(hidden, weight, targets, *, bias=None, temperature=1.0, mask=None,
                          weight_layout="hv", g_logp=None, g_ent=None):
  """float64 logp, entropy and (with cotangents) gradients, all in NumPy.

  ``z = (h W + b) / temperature``; ``logp = z[t] - lse(z)``; ``entropy = lse -
  sum p z``; ``dz = (g_logp (onehot - p) - g_ent p (z - sum p z)) / temperature``;
  ``dh = dz W^T``, ``dW = h^T dz`` (``dz^T h`` for ``"vh"``), ``db = sum_t dz``.
  Masked rows give 0 and no gradient (whatever they hold); active out-of-range
  targets give NaN.

  Returns:
    ``dict`` with ``logp`` and ``entropy`` (shape of ``targets``) and, when
    ``g_logp`` or ``g_ent`` is given, ``dh``, ``dw``, ``db`` (float64).
  """
  h = _f64(hidden)
  w = _f64(weight)
  if weight_layout == "vh":
    w = w.T
  lead = h.shape[:-1]
  h = h.reshape(-1, h.shape[-1])
  t = np.asarray(targets).reshape(-1).astype(np.int64)
  act = np.ones(t.shape, bool) if mask is None else np.asarray(mask).reshape(-1).astype(bool)
  h = np.where(act[:, None], h, 0.0)
  v = w.shape[1]
  z = h @ w
  if bias is not None:
    z = z + _f64(bias)[None]
  z = z / float(temperature)
  zmax = z.max(axis=1, keepdims=True)
  lse = np.log(np.exp(z - zmax).sum(axis=1)) + zmax[:, 0]
  p = np.exp(z - lse[:, None])
  mean_z = (p * z).sum(axis=1)
  valid = (t >= 0) & (t < v)
  zt = z[np.arange(len(t)), np.clip(t, 0, v - 1)]
  logp = np.where(valid, zt - lse, np.nan)
  ent = lse - mean_z
  logp = np.where(act, logp, 0.0)
  ent = np.where(act, ent, 0.0)
  out = {"logp": logp.reshape(lead), "entropy": ent.reshape(lead)}
  if g_logp is None and g_ent is None:
    return out
  gl = np.zeros(len(t)) if g_logp is None else np.asarray(g_logp, np.float64).reshape(-1)
  ge = np.zeros(len(t)) if g_ent is None else np.asarray(g_ent, np.float64).reshape(-1)
  gl = np.where(act, gl, 0.0)
  ge = np.where(act, ge, 0.0)
  onehot = np.zeros_like(z)
  onehot[np.arange(len(t))[valid], t[valid]] = 1.0
  dz = (gl[:, None] * (onehot - p) - ge[:, None] * p * (z - mean_z[:, None])) / temperature
  dz = np.where(act[:, None], dz, 0.0)
  out["dh"] = (dz @ w.T).reshape(*lead, -1)
  out["dw"] = (h.T @ dz) if weight_layout == "hv" else (dz.T @ h)
  out["db"] = dz.sum(axis=0)
  return out
