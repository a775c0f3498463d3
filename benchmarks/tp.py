"""Vocab-parallel ``linear_logp`` scaling on one host's GPUs (NCCL).

  PYTHONPATH=$PWD python benchmarks/tp.py [--quick] [--out benchmarks/results/tp_<device>.md]

bf16, T = 8192, H = 4096, V = 151936 (padded per TP degree to the tile grid),
logp + entropy. For TP = 1, 2, 4, ... up to the number of GPUs: forward and
forward+backward (grads w.r.t. hidden and the weight shard) wall time per step
(every device runs the step concurrently, so this is the per-device time),
with the bitwise ``all_gather`` merge and with the ``psum`` merge, against the
unsharded ``linear_logp`` on one GPU; and whether each result is bitwise equal
to the unsharded one. Wall clock (synchronised, median of ``--iters``): CUPTI
would sum the kernels of all GPUs. The row-parallel layers (o_proj, down_proj) and the
whole sharded model are measured by ``benchmarks/tp_model.py``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_kernels.linear_logp import linear_logp
from jaxrl_kernels.linear_logp.vocab_parallel import pad_vocab, vocab_parallel_logp


def wall_ms(f, *args, iters: int) -> float:
  jax.block_until_ready(f(*args))
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    samples.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(samples)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--t", type=int, default=8192)
  p.add_argument("--h", type=int, default=4096)
  p.add_argument("--v", type=int, default=151936)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--quick", action="store_true", help="T=2048 and 5 iterations")
  p.add_argument("--out", default=None, help="append the markdown table to this file")
  args = p.parse_args(argv)
  if args.quick:
    args.t, args.iters = 2048, 5
  devs = jax.devices()
  t, h, v = args.t, args.h, args.v
  k = jax.random.split(jax.random.key(0), 3)
  x = (jax.random.normal(k[0], (t, h), jnp.float32)).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (h, v), jnp.float32) * h**-0.5).astype(jnp.bfloat16)
  tg = jax.random.randint(k[2], (t,), 0, v)

  def loss_of(fn):
    def loss(hh, ww):
      lp, ent = fn(hh, ww)
      return jnp.sum(lp) + 0.1 * jnp.sum(ent)
    return loss

  base = lambda hh, ww: linear_logp(hh, ww, tg, return_entropy=True)
  fwd1 = jax.jit(base)
  fb1 = jax.jit(jax.grad(loss_of(base), argnums=(0, 1)))
  ref_lp, ref_ent = (np.asarray(a) for a in fwd1(x, w))
  t_f1 = wall_ms(fwd1, x, w, iters=args.iters)
  t_fb1 = wall_ms(fb1, x, w, iters=args.iters)
  rows = [("unsharded (1 GPU)", 1, "-", t_f1, t_fb1, True)]
  tps = [n for n in (1, 2, 4, 8) if n <= len(devs)]
  for tp in tps:
    mesh = Mesh(np.asarray(devs[:tp]), ("tp",))
    wp = jax.device_put(pad_vocab(w, tp), NamedSharding(mesh, P(None, "tp")))
    xr = jax.device_put(x, NamedSharding(mesh, P()))
    for merge in ("all_gather", "psum"):
      fn = functools.partial(vocab_parallel_logp, targets=tg, mesh=mesh,
                             weight_spec=P(None, "tp"), vocab_size=v, return_entropy=True,
                             merge=merge)
      op = lambda hh, ww, fn=fn: fn(hh, ww)
      fwd = jax.jit(op)
      fb = jax.jit(jax.grad(loss_of(op), argnums=(0, 1)))
      lp, ent = (np.asarray(a) for a in fwd(xr, wp))
      same = bool(np.array_equal(lp.view(np.uint32), ref_lp.view(np.uint32))
                  and np.array_equal(ent.view(np.uint32), ref_ent.view(np.uint32)))
      rows.append((f"TP={tp}", tp, merge, wall_ms(fwd, xr, wp, iters=args.iters),
                   wall_ms(fb, xr, wp, iters=args.iters), same))
      print(rows[-1], flush=True)
  dev = devs[0]
  lines = [
      f"\n### Vocab-parallel linear_logp, {len(devs)} x {dev.device_kind}, jax {jax.__version__}, "
      f"{datetime.date.today()}",
      "",
      f"bf16, T={t}, H={h}, V={v}, logp + entropy; wall ms per step (median of {args.iters}); "
      "ratios vs the TP=1 all_gather row.",
      "",
      "| config | merge | fwd ms | fwd+bwd ms | fwd / TP1 | fwd+bwd / TP1 | bitwise = unsharded |",
      "|---|---|---|---|---|---|---|",
  ]
  tp1 = next((r for r in rows if r[1] == 1 and r[2] == "all_gather"), rows[0])
  for name, _, merge, tf, tfb, same in rows:
    lines.append(f"| {name} | {merge} | {tf:.2f} | {tfb:.2f} | {tf / tp1[3]:.2f} | "
                 f"{tfb / tp1[4]:.2f} | {'yes' if same else 'no'} |")
  table = "\n".join(lines)
  print(table)
  if args.out:
    with open(args.out, "w") as f:
      f.write(table + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
