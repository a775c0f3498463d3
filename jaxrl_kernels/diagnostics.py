"""Drift diagnostics: how far one set of log-probs is from another, and where.

Used to compare a candidate (e.g. the trainer's log-probs, a TP-sharded result, a
new kernel) with a reference (the rollout engine's log-probs, the unsharded
result, the XLA reference). Host-side numpy: call it outside ``jit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl_kernels import _validation as val

#: The PPO clip range at which ``clipfrac0`` counts a token as clipped.
CLIP0 = 0.2


@dataclasses.dataclass(frozen=True)
class WorstToken:
  """The active token with the largest ``|candidate - reference|`` (NaN/inf first)."""

  flat_index: int
  index: tuple[int, ...]
  token_id: int
  candidate: float
  reference: float
  error: float  # candidate - reference (signed)
  rank: int | None = None  # owning vocab shard, when shard_ranges is given
  vocab_range: tuple[int, int] | None = None  # [start, end) of that shard


@dataclasses.dataclass(frozen=True)
class DriftReport:
  r"""Summary of ``d = candidate - reference`` over the active tokens.

  Attributes:
    num_active: active (unmasked) tokens.
    bitwise_equal: same dtype and identical raw bits at every active token.
    max_abs_error, mean_abs_error: of :math:`|d|` (NaN if any ``d`` is NaN).
    max_rel_error: of :math:`|d| / |reference|` (0 where ``d = 0``, inf where
      only the reference is 0).
    approx_kl0: :math:`\mathrm{mean}(e^d - 1 - d)`, the k3 KL estimate a PPO step
      would see at ratio :math:`e^d` before any update.
    clipfrac0: fraction of active tokens with :math:`|e^d - 1| > 0.2` (clipped at
      step 0 with clip 0.2).
    num_nonfinite: active tokens where ``d`` is NaN or inf.
    worst: the worst token, or None when nothing is active.
    shard_ranges: the vocab ranges the worst token was attributed with, if any.
  """

  num_active: int
  bitwise_equal: bool
  max_abs_error: float
  mean_abs_error: float
  max_rel_error: float
  approx_kl0: float
  clipfrac0: float
  num_nonfinite: int
  worst: WorstToken | None
  shard_ranges: tuple[tuple[int, int], ...] | None = None

  def table(self) -> str:
    """A readable multi-line table."""
    rows = [
        ("active tokens", f"{self.num_active}"),
        ("bitwise equal", "yes" if self.bitwise_equal else "no"),
        ("max |d|", f"{self.max_abs_error:.3e}"),
        ("mean |d|", f"{self.mean_abs_error:.3e}"),
        ("max |d|/|ref|", f"{self.max_rel_error:.3e}"),
        ("approx_kl0", f"{self.approx_kl0:.3e}   mean(e^d - 1 - d)"),
        ("clipfrac0", f"{self.clipfrac0:.4f}   |e^d - 1| > {CLIP0}"),
        ("non-finite d", f"{self.num_nonfinite}"),
    ]
    w = self.worst
    if w is None:
      rows.append(("worst token", "none (no active token)"))
    else:
      owner = ""
      if w.rank is not None:
        owner = f"   rank {w.rank}, vocab [{w.vocab_range[0]}, {w.vocab_range[1]})"
      elif self.shard_ranges is not None:
        owner = "   owned by no shard"
      rows += [
          ("worst token", f"flat {w.flat_index}, index {w.index}"),
          ("  token id", f"{w.token_id}{owner}"),
          ("  candidate", f"{w.candidate:.9g}"),
          ("  reference", f"{w.reference:.9g}"),
          ("  d = c - r", f"{w.error:+.3e}"),
      ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["logprob drift (d = candidate - reference)"] +
                     [f"  {k:<{width}}  {v}" for k, v in rows])

  def __str__(self) -> str:
    return self.table()


def _check_ranges(shard_ranges) -> list[tuple[int, int]]:
  try:
    pairs = [tuple(p) for p in shard_ranges]
  except TypeError:
    raise TypeError(f"logprob_drift: shard_ranges must be a sequence of (start, end) pairs, got "
                    f"{shard_ranges!r}") from None
  ranges = []
  for r, p in enumerate(pairs):
    if len(p) != 2:
      raise ValueError(f"logprob_drift: shard_ranges[{r}] must be a (start, end) pair, got {p}")
    ranges.append(tuple(val.check_int("logprob_drift", f"shard_ranges[{r}]", x) for x in p))
  for r, (a, b) in enumerate(ranges):
    if not 0 <= a < b:
      raise ValueError(f"logprob_drift: shard_ranges[{r}] must be [start, end) with "
                       f"0 <= start < end, got {(a, b)}")
    if r and a < ranges[r - 1][1]:
      raise ValueError(f"logprob_drift: shard_ranges must be ordered by rank and not overlap; "
                       f"rank {r} starts at {a} before rank {r - 1} ends at {ranges[r - 1][1]}")
  return ranges


def _float_host(x, name: str) -> np.ndarray:
  if not val.is_concrete(x):
    raise TypeError(f"logprob_drift: {name} must be a concrete array (call it outside jit), "
                    f"got a traced value")
  a = np.asarray(x)
  if val.dtype_kind(a.dtype) != "f":
    raise TypeError(f"logprob_drift: {name} must be a float array of log-probs, got {a.dtype}")
  return a


def logprob_drift(candidate, reference, targets, mask=None, *,
                  shard_ranges: Sequence[tuple[int, int]] | None = None) -> DriftReport:
  r"""Compares two log-prob arrays token by token and locates the worst token.

  Args:
    candidate: ``[...]`` log-probs under test (any float dtype, numpy or jax).
    reference: ``[...]`` log-probs to compare against.
    targets: ``[...]`` int token ids the log-probs belong to (must fit int32).
    mask: optional ``[...]`` bool or exact 0/1 (list, numpy or jax); default all active.
      Masked tokens may hold anything (NaN included) and are ignored.
    shard_ranges: optional ``[(start, end), ...]`` vocab range ``[start, end)`` of
      each TP rank, in rank order; the worst token is then attributed to the
      rank owning its id.

  Returns:
    A frozen :class:`DriftReport`; ``print(report)`` shows a table. Statistics
    are computed in float64 with ``d = candidate - reference``.
  """
  fn = "logprob_drift"
  cand, ref = _float_host(candidate, "candidate"), _float_host(reference, "reference")
  tgt = np.asarray(val.as_ids(fn, "targets", targets))
  if cand.shape != ref.shape or tgt.shape != cand.shape:
    raise ValueError(f"{fn}: candidate {cand.shape}, reference {ref.shape} and targets "
                     f"{tgt.shape} must have the same shape")
  active = (np.ones(cand.shape, bool) if mask is None else
            np.asarray(val.as_mask(fn, "mask", mask, cand.shape)))
  ranges = None if shard_ranges is None else tuple(_check_ranges(shard_ranges))

  flat_idx = np.flatnonzero(active)
  c = cand.reshape(-1)[flat_idx]
  r = ref.reshape(-1)[flat_idx]
  n = int(flat_idx.size)
  bitwise = cand.dtype == ref.dtype and bool(np.array_equal(
      c.view(f"u{c.dtype.itemsize}"), r.view(f"u{r.dtype.itemsize}")))
  if n == 0:
    return DriftReport(0, bitwise, 0.0, 0.0, 0.0, 0.0, 0.0, 0, None, ranges)

  with np.errstate(all="ignore"):
    d = c.astype(np.float64) - r.astype(np.float64)
    ad = np.abs(d)
    rel = np.where(ad == 0, 0.0, ad / np.abs(r.astype(np.float64)))
    ratio_m1 = np.expm1(d)
    kl0 = float(np.mean(ratio_m1 - d))
    clip0 = float(np.mean(np.abs(ratio_m1) > CLIP0))
  finite = np.isfinite(d)
  k = int(np.argmax(np.where(finite, ad, np.inf)))  # the first non-finite token, else max |d|
  flat = int(flat_idx[k])
  token = int(tgt.reshape(-1)[flat])
  rank = vocab_range = None
  if ranges is not None:
    owners = [i for i, (a, b) in enumerate(ranges) if a <= token < b]
    if owners:
      rank, vocab_range = owners[0], ranges[owners[0]]
  index = tuple(int(i) for i in np.unravel_index(flat, cand.shape))
  worst = WorstToken(flat_index=flat, index=index, token_id=token, candidate=float(c[k]),
                     reference=float(r[k]), error=float(d[k]), rank=rank, vocab_range=vocab_range)
  return DriftReport(
      num_active=n, bitwise_equal=bitwise, max_abs_error=float(np.max(ad)),
      mean_abs_error=float(np.mean(ad)), max_rel_error=float(np.max(rel)), approx_kl0=kl0,
      clipfrac0=clip0, num_nonfinite=int(np.sum(~finite)), worst=worst,
      shard_ranges=ranges)
