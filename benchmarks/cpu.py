"""CPU benchmark: the README example on ``implementation="cpu"`` vs plain XLA.

  PYTHONPATH=$PWD python benchmarks/cpu.py [--shape 1024x1024x32000] [--repeats 3]
      [--out benchmarks/results/cpu_<machine>.md]

The README example, bf16, ``T x H x V``: ``det_matmul(x, w[:, :4096])``, the
``linear_logp`` forward, and ``jax.grad`` of ``linear_logp(...).mean()`` w.r.t.
the weight, each under ``jax.jit``. The baseline does the same with ``jnp.dot``
and ``jax.nn.log_softmax`` (``[T, V]`` float32 logits; not batch-invariant).
Each implementation runs in a fresh process with XLA's default flags, so the
first call of each step includes its compilation: the table gives the first
call (compile + run), the median of ``--repeats`` later calls, the whole
example from a cold start, and the process CPU seconds (on a shared machine,
wall time also measures the neighbours; CPU seconds do not).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

_CHILD = "--child"


def _example(impl: str, t: int, h: int, v: int):
  import jax
  import jax.numpy as jnp

  from jaxrl_kernels import det_matmul, linear_logp

  kx, kw, kt = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (t, h), jnp.bfloat16)
  w = (jax.random.normal(kw, (h, v), jnp.float32) * 0.02).astype(jnp.bfloat16)
  tg = jax.random.randint(kt, (t,), 0, v)
  w_mm = w[:, :4096]

  if impl == "cpu":
    mm = jax.jit(lambda x, w: det_matmul(x, w, implementation="cpu"))

    def logp(x, w, tg):
      return linear_logp(x, w, tg, implementation="cpu")
  else:
    mm = jax.jit(lambda x, w: jnp.dot(x, w))

    def logp(x, w, tg):
      z = jnp.dot(x, w, preferred_element_type=jnp.float32)
      return jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), tg[:, None], axis=-1)[:, 0]

  fwd = jax.jit(logp)
  grad = jax.jit(jax.grad(lambda x, w, tg: logp(x, w, tg).mean(), argnums=1))
  steps = {"det_matmul": (mm, (x, w_mm)), "linear_logp forward": (fwd, (x, w, tg)),
           "grad(linear_logp) w.r.t. W": (grad, (x, w, tg))}
  return steps


def _child(impl: str, t: int, h: int, v: int, repeats: int) -> dict:
  import jax

  from jaxrl_kernels import _backend

  cpu0, wall0 = time.process_time(), time.perf_counter()
  steps = _example(impl, t, h, v)
  rows = {}
  for name, (f, args) in steps.items():
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    rows[name] = {"first_s": time.perf_counter() - t0}
  total_wall = time.perf_counter() - wall0
  total_cpu = time.process_time() - cpu0
  for name, (f, args) in steps.items():
    samples = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      samples.append(time.perf_counter() - t0)
    rows[name]["steady_s"] = statistics.median(samples)
  return {"rows": rows, "total_wall_s": total_wall, "total_cpu_s": total_cpu,
          "fma": bool(_backend.cpu_contracts_fma()), "jax": jax.__version__}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="1024x1024x32000", help="TxHxV")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--impls", default="cpu,xla")
  p.add_argument("--out", default=None)
  p.add_argument(_CHILD, default=None, help=argparse.SUPPRESS)
  a = p.parse_args()
  t, h, v = (int(s) for s in a.shape.split("x"))
  if a.child:
    print("RESULT " + json.dumps(_child(a.child, t, h, v, a.repeats)), flush=True)
    return
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # XLA's default CPU flags: no --xla_cpu_max_isa (FMA contraction stays on).
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_cpu_max_isa"))
  results = {}
  for impl in a.impls.split(","):
    proc = subprocess.run([sys.executable, __file__, "--shape", a.shape, "--repeats",
                           str(a.repeats), _CHILD, impl], env=env, capture_output=True,
                          text=True, check=True)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    results[impl] = json.loads(line[len("RESULT "):])
    print(impl, json.dumps(results[impl], indent=1), flush=True)
  report = _report(results, t, h, v, a)
  print(report)
  if a.out:
    with open(a.out, "w") as f:
      f.write(report)


def _report(results: dict, t: int, h: int, v: int, a) -> str:
  any_r = next(iter(results.values()))
  load = os.getloadavg()
  lines = [
      f"# CPU: the README example, `implementation=\"cpu\"` vs plain XLA ({platform.node()})",
      "",
      f"- machine: {_cpu_name()}, {os.cpu_count()} cores; load average at the end "
      f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)",
      f"- jax {any_r['jax']}, XLA's default CPU flags (FMA contraction on: {any_r['fma']})",
      f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
      f"- command: `PYTHONPATH=$PWD python benchmarks/cpu.py --shape {a.shape} "
      f"--repeats {a.repeats}`",
      f"- shapes: bf16, T = {t}, H = {h}, V = {v}; det_matmul on `w[:, :4096]`",
      "",
      "| step | impl | first call (compile + run) s | later calls (median) s |",
      "| --- | --- | ---: | ---: |",
  ]
  for name in any_r["rows"]:
    for impl, r in results.items():
      row = r["rows"][name]
      lines.append(f"| {name} | {impl} | {row['first_s']:.2f} | {row['steady_s']:.2f} |")
  lines += ["", "| impl | whole example from a cold start: wall s | process CPU s |",
            "| --- | ---: | ---: |"]
  for impl, r in results.items():
    lines.append(f"| {impl} | {r['total_wall_s']:.2f} | {r['total_cpu_s']:.2f} |")
  if "cpu" in results and "xla" in results:
    c, x = results["cpu"], results["xla"]
    lines += ["", "Ratios cpu / xla: whole example wall "
              f"{c['total_wall_s'] / x['total_wall_s']:.2f}x, CPU seconds "
              f"{c['total_cpu_s'] / x['total_cpu_s']:.2f}x; later calls: " + ", ".join(
                  f"{n} {c['rows'][n]['steady_s'] / x['rows'][n]['steady_s']:.2f}x"
                  for n in c["rows"]) + "."]
  return "\n".join(lines) + "\n"


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for ln in f:
        if ln.startswith("model name"):
          return ln.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown CPU"


if __name__ == "__main__":
  main()
