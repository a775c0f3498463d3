"""GEMM benchmark: det_matmul implementations vs jnp.dot, measured in the same run.

  PYTHONPATH=$PWD python benchmarks/gemm.py [--quick] [--impls mosaic,triton] [--out FILE]

Prints (and writes with --out) a markdown table: forward and forward+backward
TFLOP/s of each implementation and of ``jnp.dot``, the ratio, and whether the
sampled rows were bitwise batch-invariant (row r of the M-row call against the
same row computed alone).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _timing import copies_for, device_ms

from jaxrl_kernels import det_matmul

MS = (1, 16, 64, 256, 1024, 4096, 8192)
HBM_PEAK_TBS = 3.35  # H100 SXM HBM3
KNS = ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 151936))


def _mm(impl):
  if impl == "jnp.dot":
    return lambda a, b: jnp.dot(a, b)
  return lambda a, b: det_matmul(a, b, implementation=impl)


def _fwd(impl):
  """Forward over several weight copies (so no run finds its weight in L2)."""
  mm = _mm(impl)
  return jax.jit(lambda a, bs: [mm(a, b) for b in bs])


def _fwd_bwd(impl):
  mm = _mm(impl)

  def step(a, bs, g):
    # One cotangent per weight copy: with a shared one, dB = A^T g would be the
    # same product for every copy and XLA computes it once (CSE), which made
    # jnp.dot's f+b look faster than three GEMMs can run.
    outs = []
    for i, b in enumerate(bs):
      out, vjp = jax.vjp(mm, a, b)
      outs.append((out, vjp(g * (1.0 + i / 64))))
    return outs

  return jax.jit(step)


def _bits(x):
  return np.asarray(x).view(np.uint16)


def run(impls, ms, kns, fwd_bwd: bool, out=None):
  rows = []
  for k, n in kns:
    reps = copies_for(k * n * 2)
    bs = [jax.random.normal(jax.random.key(10 + i), (k, n), jnp.bfloat16) for i in range(reps)]
    b = bs[0]
    for m in ms:
      a = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
      flops = 2.0 * m * n * k
      row = {"m": m, "k": k, "n": n}
      row["jnp.dot"] = flops * reps / device_ms(_fwd("jnp.dot"), a, bs) / 1e9
      if m == 1:  # a GEMV streams the weight once: what a plain read of it reaches
        read = jax.jit(lambda bs: [jnp.sum(b, axis=0, dtype=jnp.float32) for b in bs])
        row["read"] = 2.0 * k * n * reps / device_ms(read, bs) / 1e9
      if fwd_bwd:
        g = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
        row["jnp.dot_fb"] = 3 * flops * reps / device_ms(_fwd_bwd("jnp.dot"), a, bs, g) / 1e9
      for impl in impls:
        try:
          row[impl] = flops * reps / device_ms(_fwd(impl), a, bs) / 1e9
          f = jax.jit(_mm(impl))
          full = f(a, b)
          probe = sorted({0, m // 2, m - 1})
          row[impl + "_inv"] = all(
              np.array_equal(_bits(f(a[r:r + 1], b)), _bits(full[r:r + 1])) for r in probe)
          if fwd_bwd:
            row[impl + "_fb"] = 3 * flops * reps / device_ms(_fwd_bwd(impl), a, bs, g) / 1e9
        except Exception as e:  # noqa: BLE001 - report the failure in the table, keep going
          print(f"  {impl} failed at M={m} K={k} N={n}: {type(e).__name__}: {str(e)[:200]}")
          row[impl], row[impl + "_inv"], row[impl + "_fb"] = float("nan"), False, float("nan")
      rows.append(row)
      print(_fmt_row(row, impls, fwd_bwd), flush=True)
      if out:
        with open(out, "a") as fh:
          fh.write(_fmt_row(row, impls, fwd_bwd) + "\n")
  return rows


def _header(impls, fwd_bwd):
  cols = ["M", "K", "N", "jnp.dot fwd"]
  for impl in impls:
    cols += [f"{impl} fwd", "ratio", "bitwise"]
  if fwd_bwd:
    cols += ["jnp.dot f+b"]
    for impl in impls:
      cols += [f"{impl} f+b", "ratio"]
  return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def _fmt_row(r, impls, fwd_bwd):
  cells = [str(r["m"]), str(r["k"]), str(r["n"]), f"{r['jnp.dot']:.1f}"]
  for impl in impls:
    cells += [f"{r[impl]:.1f}", f"{r[impl] / r['jnp.dot']:.2f}x",
              "yes" if r[impl + "_inv"] else "NO"]
  if fwd_bwd:
    cells += [f"{r['jnp.dot_fb']:.1f}"]
    for impl in impls:
      cells += [f"{r[impl + '_fb']:.1f}", f"{r[impl + '_fb'] / r['jnp.dot_fb']:.2f}x"]
  return "| " + " | ".join(cells) + " |"


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--quick", action="store_true", help="a few shapes only")
  p.add_argument("--impls", default=None, help="comma-separated (default: mosaic on Hopper)")
  p.add_argument("--no-bwd", action="store_true", help="forward only")
  p.add_argument("--ms", default=None, help="comma-separated M values")
  p.add_argument("--kns", default=None, help="comma-separated KxN weight shapes, e.g. 4096x4096")
  p.add_argument("--out", default=None, help="write the markdown table here")
  args = p.parse_args()
  from jaxrl_kernels._backend import is_hopper
  impls = args.impls.split(",") if args.impls else (["mosaic"] if is_hopper() else ["triton"])
  ms = tuple(int(x) for x in args.ms.split(",")) if args.ms else MS
  kns = KNS
  if args.kns:
    kns = tuple(tuple(int(v) for v in kn.split("x")) for kn in args.kns.split(","))
  if args.quick:
    ms, kns = (1, 64, 1024, 8192), KNS[:2]
  dev = jax.devices()[0]
  head = (f"device: {dev.device_kind}; jax {jax.__version__}; "
          f"date {datetime.date.today().isoformat()}; bf16 inputs and outputs, fp32 accumulation; "
          f"TFLOP/s from CUPTI kernel time (f+b counts 3 GEMMs), weights rotated past L2; "
          f"ratio = impl / jnp.dot; command: python3 {shlex.join(sys.argv)}")
  print(head)
  print(_header(impls, not args.no_bwd), flush=True)
  if args.out:  # a run replaces the file; rows are appended as measured, so a cut run keeps them
    with open(args.out, "w") as fh:
      fh.write(head + "\n\n" + _header(impls, not args.no_bwd) + "\n")
  rows = run(impls, ms, kns, fwd_bwd=not args.no_bwd, out=args.out)
  gemv = [r for r in rows if "read" in r]
  if gemv:
    # At M = 1, 2 K N flops are the 2 K N bytes of the weight: TFLOP/s is TB/s.
    title = (f"M = 1 against HBM bandwidth ({HBM_PEAK_TBS} TB/s peak); read = an XLA column "
             "sum of the same weight, float32 accumulation (what XLA's streaming read reaches "
             "at this size):")
    cols = ["K", "N", "weight MB", "read TB/s (% peak)", "jnp.dot TB/s (% peak)",
            *(f"{i} TB/s (% peak)" for i in impls)]
    lines = ["", title, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in gemv:
      cells = [str(r["k"]), str(r["n"]), f"{2 * r['k'] * r['n'] / 1e6:.1f}"]
      cells += [f"{r[c]:.2f} ({100 * r[c] / HBM_PEAK_TBS:.0f}%)"
                for c in ("read", "jnp.dot", *impls)]
      lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out:
      with open(args.out, "a") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
