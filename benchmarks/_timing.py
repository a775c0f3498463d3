"""Device timing shared by the benchmarks: CUPTI kernel time where available."""

from __future__ import annotations

import statistics
import time

import jax

L2_BYTES = 50 * 2**20  # H100; rotate operands so repeated runs do not hit the cache


def copies_for(nbytes: int, cap: int = 8) -> int:
  """How many copies of an operand of ``nbytes`` to rotate through (>= 3x the L2)."""
  return max(1, min(cap, -(-3 * L2_BYTES // max(nbytes, 1))))


def device_ms(f, *args, iterations: int = 20) -> float:
  """Median milliseconds of the device kernels ``f(*args)`` launches.

  Uses CUPTI (``jax.experimental.mosaic.gpu.profiler.measure``), which sums the
  kernels' own time and leaves out host dispatch; falls back to a synchronised
  wall clock when CUPTI is unavailable.
  """
  jax.block_until_ready(f(*args))
  try:
    from jax.experimental.mosaic.gpu import profiler
    _, times = profiler.measure(f, iterations=iterations)(*args)
    if times:
      return statistics.median(times)
  except Exception:  # noqa: BLE001 - fall back to wall clock
    pass
  samples = []
  for _ in range(iterations):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    samples.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(samples)


# Kernel name fragments of each class (CUPTI names; XLA's own kernels and the library's).
_CLASSES = (
    ("attention", ("attention", "fmha", "flash", "cudnn", "sdpa")),
    ("reduction", ("det_sum", "det_prod", "det_cum", "reduce", "softmax", "_rows")),
    ("GEMM", ("matmul", "gemm", "nvjet", "xmma", "cutlass", "cublas", "dot", "mosaic",
              "kernel")),
)


def kernel_class(name: str) -> str:
  """``"attention"``, ``"reduction"``, ``"GEMM"`` or ``"other"`` for a kernel name."""
  low = name.lower()
  for cls, frags in _CLASSES:
    if any(f in low for f in frags):
      return cls
  return "other"


class _Dispatched(jax.stages.Wrapped):
  """``f`` as it is: ``profiler.measure`` wraps anything else in ``jax.jit``, and an outer
  trace around a function that calls ``nnx.jit`` on a module it closes over breaks it."""

  def __init__(self, f):
    self._f = f

  def __call__(self, *args, **kwargs):
    return self._f(*args, **kwargs)

  def trace(self, *args, **kwargs):
    raise NotImplementedError

  def lower(self, *args, **kwargs):
    raise NotImplementedError


def kernel_breakdown(f, *args) -> list[tuple[str, float]] | None:
  """``[(kernel name, ms), ...]`` of one call of ``f`` (CUPTI), or None without CUPTI."""
  jax.block_until_ready(f(*args))
  try:
    from jax.experimental.mosaic.gpu import profiler
    _, timings = profiler.measure(_Dispatched(f), aggregate=False)(*args)
  except Exception:  # noqa: BLE001 - no CUPTI here (CPU): no breakdown
    return None
  return list(timings) if timings else None


def breakdown_lines(title: str, timings: list[tuple[str, float]] | None, top: int) -> list[str]:
  if timings is None:
    return [f"\n{title}: no per-kernel breakdown (CUPTI is unavailable on this device)"]
  total = sum(ms for _, ms in timings) or 1.0
  by_class: dict[str, list[float]] = {}
  for name, ms in timings:
    by_class.setdefault(kernel_class(name), []).append(ms)
  lines = [f"\n{title}: {total:.3f} ms in {len(timings)} kernels",
           "", "| class | kernels | ms | share |", "|---|---|---|---|"]
  for cls in ("GEMM", "reduction", "attention", "other"):
    ms = by_class.get(cls, [])
    lines.append(f"| {cls} | {len(ms)} | {sum(ms):.3f} | {100 * sum(ms) / total:.1f}% |")
  agg: dict[str, list[float]] = {}
  for name, ms in timings:
    agg.setdefault(name, []).append(ms)
  longest = sorted(agg.items(), key=lambda kv: -sum(kv[1]))[:top]
  lines += ["", f"longest kernels (of {len(agg)} distinct):", "",
            "| kernel | class | calls | ms | share |", "|---|---|---|---|---|"]
  for name, ms in longest:
    short = name if len(name) <= 70 else name[:67] + "..."
    lines.append(f"| `{short}` | {kernel_class(name)} | {len(ms)} | {sum(ms):.3f} | "
                 f"{100 * sum(ms) / total:.1f}% |")
  return lines


def per_step(short: list[tuple[str, float]] | None, long: list[tuple[str, float]] | None,
             steps: int) -> list[tuple[str, float]] | None:
  """The kernels one loop step adds: ``long`` (a call with ``steps`` more loop steps than
  ``short``) minus ``short``, per name, divided by ``steps``; one entry per kernel launch of
  a step, each with its mean time. None when either breakdown is."""
  if short is None or long is None:
    return None
  agg: dict[str, list[float]] = {}
  for sign, timings in ((-1, short), (1, long)):
    for name, ms in timings:
      n, t = agg.setdefault(name, [0, 0.0])
      agg[name] = [n + sign, t + sign * ms]
  out = []
  for name, (n, t) in agg.items():
    calls = round(n / steps)
    if calls > 0 and t > 0:
      out += [(name, t / steps / calls)] * calls
  return out
