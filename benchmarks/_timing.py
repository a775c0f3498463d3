"""Device timing shared by the benchmarks: CUPTI kernel time where available."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

L2_BYTES = 50 * 2**20  # H100; rotate operands so repeated runs do not hit the cache


def pipelined_ms(fn, arg_sets, calls: int) -> float:
  """Milliseconds per call of ``calls`` calls enqueued back to back (cycling through
  ``arg_sets``, a list of argument tuples) and one block at the end, as a training or
  sampling loop runs them. Compiles and warms up on every argument set first."""
  for args in arg_sets:
    jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  outs = [fn(*arg_sets[i % len(arg_sets)]) for i in range(calls)]
  jax.block_until_ready(outs)
  return (time.perf_counter() - t0) * 1e3 / calls


def head_sweep(description: str, measure, table, *, rows: str, hidden: str, hbm: float,
               title: str, caption: str) -> None:
  """The LM-head benchmarks' command line: ``measure(t, hidden, vocab, calls=,
  implementation=, layout=)`` at every ``--hidden`` x ``--rows`` shape, then
  ``# {title}: {device}``, the ``caption`` (formatted with ``calls`` and ``hbm``) and
  ``table(rows, hbm)``, printed and written to ``--out``. ``rows``, ``hidden``, ``hbm``: the
  defaults of those flags."""
  import argparse
  import datetime

  ap = argparse.ArgumentParser(description=description)
  ap.add_argument("--rows", default=rows, help="comma-separated T")
  ap.add_argument("--hidden", default=hidden, help="comma-separated H")
  ap.add_argument("--vocab", type=int, default=151936)
  ap.add_argument("--calls", type=int, default=50, help="calls enqueued per timing")
  ap.add_argument("--implementation", default=None,
                  help="linear_logp implementation of our paths (default: by device)")
  ap.add_argument("--hbm", type=float, default=hbm, help="HBM TB/s of the floor column")
  ap.add_argument("--layout", default="hv", choices=("hv", "vh"),
                  help="the weight: [H, V] (hv) or a tied embedding's [V, H] (vh)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  results = []
  for h in (int(x) for x in args.hidden.split(",")):
    for t in (int(x) for x in args.rows.split(",")):
      results.append(measure(t, h, args.vocab, calls=args.calls,
                             implementation=args.implementation, layout=args.layout))
      print(results[-1], flush=True)
  dev = jax.devices()[0]
  lines = [f"# {title}: {getattr(dev, 'device_kind', dev.platform)}", "",
           f"jax {jax.__version__}; {datetime.date.today()}; weight layout {args.layout!r}; "
           + caption.format(calls=args.calls, hbm=args.hbm), "", *table(results, args.hbm)]
  text = "\n".join(lines) + "\n"
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)


def head_weight(key, hidden: int, vocab: int, layout: str, scale: float) -> jax.Array:
  """A bf16 LM-head weight: ``[H, V]`` (``"hv"``) or a tied embedding's ``[V, H]``
  (``"vh"``), normal times ``scale``."""
  shape = (hidden, vocab) if layout == "hv" else (vocab, hidden)
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)


def head_product(h: jax.Array, w: jax.Array, layout: str) -> jax.Array:
  """The stock path's float32 logits ``h W`` of a :func:`head_weight`."""
  spec = "th,hv->tv" if layout == "hv" else "th,vh->tv"
  return jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)


def bits_digest(tree) -> str:
  """A short hash of every leaf's raw bytes: equal digests, equal bits (a sweep's check that a
  config kept the default's bits)."""
  import hashlib

  import numpy as np

  h = hashlib.sha1()
  for leaf in jax.tree.leaves(tree):
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()[:12]


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


def trace_launches(trace_dir: str) -> list[tuple[int, int, str, str]]:
  """``[(start_ns, end_ns, name, launch), ...]`` of the kernels (no memcpy/memset) on the
  first GPU plane of the ``jax.profiler`` trace in ``trace_dir``, by start time; [] without
  one. ``launch``: the profiler's launch details (grid, block, registers, shared memory),
  which tell apart launches of one kernel at different shapes or configs.

  Reads the trace through ``jax._src.lib._profile_data`` (the profiler's own reader; a
  private module, so this may need updating with jax)."""
  import glob
  import os

  from jax._src.lib import _profile_data

  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  for plane in (_profile_data.ProfileData.from_file(files[0]).planes if files else ()):
    if plane.name.startswith("/device:GPU"):
      events = sorted((e.start_ns, e.end_ns, e.name,
                       str(dict((k, v) for k, v in e.stats if k).get("kernel_details", "")))
                      for line in plane.lines for e in line.events)
      return [e for e in events if not any(w in e[2].lower() for w in ("memcpy", "memset"))]
  return []


def trace_kernels(trace_dir: str) -> list[tuple[int, int, str]]:
  """``[(start_ns, end_ns, name), ...]``: :func:`trace_launches` without the details."""
  return [(start, end, name) for start, end, name, _ in trace_launches(trace_dir)]


def launch_groups(launches: list[tuple[int, int, str, str]], classes=("GEMM", "attention")
                  ) -> list[tuple[str, str, int, int]]:
  """``[(name, launch, calls, total_ns), ...]`` of the launches of ``classes``
  (:func:`kernel_class`), grouped by kernel name and launch details, longest first."""
  import collections

  total, calls = collections.Counter(), collections.Counter()
  for start, end, name, launch in launches:
    if kernel_class(name) in classes:
      total[name, launch] += end - start
      calls[name, launch] += 1
  return [(name, launch, calls[name, launch], ns) for (name, launch), ns in total.most_common()]


def timeline(kernels: list[tuple[int, int, str]]) -> dict:
  """What a device timeline says (times in ns): ``span`` (first start to last end),
  ``busy`` (time some kernel runs), ``kernel_sum`` (the kernels' own times), ``overlap``
  (``kernel_sum - busy``: time kernels share), ``count``; Counters ``gaps`` / ``gap_count``
  (idle time before each kernel, by the pair of kernels around it), ``by_name`` and
  ``by_class`` (kernel time)."""
  import collections

  out = dict(span=0, busy=0, kernel_sum=0, overlap=0, count=len(kernels),
             gaps=collections.Counter(), gap_count=collections.Counter(),
             by_name=collections.Counter(), by_class=collections.Counter())
  if not kernels:
    return out
  for start, end, name in kernels:
    out["by_name"][name] += end - start
    out["by_class"][kernel_class(name)] += end - start
  cur_start, cur_end, prev = kernels[0][0], kernels[0][1], kernels[0][2]
  for start, end, name in kernels[1:]:
    if start > cur_end:
      out["busy"] += cur_end - cur_start
      pair = f"{prev[:45]} -> {name[:45]}"
      out["gaps"][pair] += start - cur_end
      out["gap_count"][pair] += 1
      cur_start, cur_end = start, end
    else:
      cur_end = max(cur_end, end)
    prev = name
  out["busy"] += cur_end - cur_start
  out["span"] = kernels[-1][1] - kernels[0][0]
  out["kernel_sum"] = sum(out["by_name"].values())
  out["overlap"] = out["kernel_sum"] - out["busy"]
  return out
