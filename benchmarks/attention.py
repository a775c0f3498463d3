"""causal_attention benchmark: the Mosaic and Triton kernels vs jax.nn.dot_product_attention.

  PYTHONPATH=$PWD python benchmarks/attention.py [--quick] [--hkv N]
      [--out benchmarks/results/attention_<device>.md]

bf16, Hq = Hkv = 32 (``--hkv`` for grouped-query), D = 128.
* prefill: causal, T = 4096, B = 1 and 4 (``--quick``: B = 1 only): forward and
  forward+backward (grads w.r.t. q, k, v) device time;
* decode: Tq = 1 against a full cache of S = 4096 keys, B = 32: forward;
  ``--decode-sweep``: decode only, B = 64 and 256 against 4k-32k-key caches (use with
  ``--hkv 8`` for grouped-query decode, as rollouts run it).
Baselines: ``jax.nn.dot_product_attention`` with ``implementation=None``, ``"xla"``
and ``"cudnn"`` (is_causal for prefill; decode sees the whole cache). Each
measurement is guarded: a failing baseline becomes an error row, the run goes on.
Ratios are against the fastest baseline measured in the same run (issue target:
forward <= 1.3x at T = 4096, 32 heads x 128).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from _timing import device_ms  # noqa: E402

T = 4096
HQ = 32
D = 128
DECODE_B = 32
DECODE_SWEEP = ((64, 4096), (64, 16384), (64, 32768), (256, 4096), (256, 16384))
IMPLS = ("jaxrl_mosaic", "jaxrl_triton", "jnp_none", "jnp_xla", "jnp_cudnn")


def _op(impl: str, causal: bool):
  if impl.startswith("jaxrl_"):
    from jaxrl_kernels.attention import causal_attention
    name = impl.removeprefix("jaxrl_")
    return lambda q, k, v: causal_attention(q, k, v, implementation=name)
  name = {"jnp_none": None, "jnp_xla": "xla", "jnp_cudnn": "cudnn"}[impl]
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                      implementation=name)


def _inputs(b, tq, s, hkv):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(k1, (b, tq, HQ, D), jnp.bfloat16)
  k = jax.random.normal(k2, (b, s, hkv, D), jnp.bfloat16)
  v = jax.random.normal(k3, (b, s, hkv, D), jnp.bfloat16)
  return q, k, v


def _measure(impl, case, b, tq, s, hkv, iterations):
  row = {"impl": impl, "case": case, "b": b, "tq": tq, "s": s}
  try:
    q, k, v = _inputs(b, tq, s, hkv)
    op = _op(impl, causal=case == "prefill")
    row["fwd_ms"] = device_ms(jax.jit(op), q, k, v, iterations=iterations)
    if case == "prefill":
      def loss(q, k, v):
        return jnp.sum(op(q, k, v).astype(jnp.float32))
      fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
      row["fb_ms"] = device_ms(fb, q, k, v, iterations=iterations)
  except Exception as e:  # noqa: BLE001 - one failing baseline must not stop the run
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
  print(row, flush=True)
  return row


def _table(rows) -> str:
  lines = ["| case | B | Tq | S | impl | fwd ms | fwd vs best jnp | fwd+bwd ms | "
           "fwd+bwd vs best jnp |", "|---|---|---|---|---|---|---|---|---|"]

  def best(r, key):
    vals = [o[key] for o in rows if not o["impl"].startswith("jaxrl_") and key in o
            and (o["case"], o["b"], o["s"]) == (r["case"], r["b"], r["s"])]
    return min(vals) if vals else None

  for r in rows:
    head = f"| {r['case']} | {r['b']} | {r['tq']} | {r['s']} | {r['impl']} |"
    if "error" in r and "fwd_ms" not in r:
      lines.append(f"{head} error: {r['error']} ||||")
      continue
    cells = []
    for key in ("fwd_ms", "fb_ms"):
      if key not in r:
        cells += ["-", "-"]
        continue
      base = best(r, key)
      cells += [f"{r[key]:.3f}", f"{r[key] / base:.2f}x" if base else "-"]
    lines.append(f"{head} {' | '.join(cells)} |")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="B = 1 prefill only, fewer iterations")
  p.add_argument("--hkv", type=int, default=HQ, help="kv heads (grouped-query when < 32)")
  p.add_argument("--impls", default=",".join(IMPLS))
  p.add_argument("--decode-sweep", action="store_true",
                 help=f"decode only, (B, S) in {DECODE_SWEEP}")
  p.add_argument("--out", default=None, help="write the markdown table to this file (overwritten)")
  args = p.parse_args()
  iterations = 5 if args.quick else 20
  cases = [("prefill", 1, T, T)] + ([] if args.quick else [("prefill", 4, T, T)])
  cases.append(("decode", DECODE_B, 1, T))
  if args.decode_sweep:
    cases = [("decode", b, 1, s) for b, s in DECODE_SWEEP]
  rows = [_measure(impl, case, b, tq, s, args.hkv, iterations)
          for case, b, tq, s in cases for impl in args.impls.split(",")]
  dev = jax.devices()[0]
  command = "python benchmarks/attention.py " + " ".join(sys.argv[1:])
  text = (f"# causal_attention benchmark\n\n- command: `{command}`\n"
          f"\n## causal_attention ({dev.device_kind}; jax {jax.__version__}; "
          f"{datetime.date.today().isoformat()})\n\nbf16, Hq={HQ}, Hkv={args.hkv}, D={D}; prefill "
          f"causal; decode = 1 query vs a full cache. CUPTI device time (median of {iterations}); "
          f"ratios vs the fastest jax.nn.dot_product_attention measured in the same run.\n\n"
          + _table(rows) + "\n")
  print(text)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
