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
