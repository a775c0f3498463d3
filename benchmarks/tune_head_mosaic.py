"""Sweep the Mosaic LM head's free knobs at sampler row counts; check every config's bits.

The sampler's per-step head kernels on Hopper: ``linear_logp_mosaic.logits`` with in-kernel
statistics (``head_logits_partials``'s kernel) and ``linear_logp_mosaic.logits_draw`` (the
draw in the head), each under the library's default config and the configs below (rows per
CTA, warpgroups per CTA, pipeline depth, hidden rows in place for the logits). Every config
must give the default's bits: the digest of all outputs is compared. The stock column is
XLA's float32 logits + ``log_softmax`` of the same weight array (``--layout``: ``[H, V]`` or
a tied embedding's ``[V, H]``); the floor is the weight read at ``--hbm`` TB/s. Times are
CUPTI kernel time (``_timing.device_ms``); the weight (>= 229 MB at V = 151936, H >= 768) is
larger than the L2.

    PYTHONPATH=$PWD python benchmarks/tune_head_mosaic.py [--rows 1,8] [--layout vh]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

from jaxrl_kernels.pallas import draw
from jaxrl_kernels.pallas import linear_logp_mosaic as lm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import bits_digest, device_ms, head_product, head_weight  # noqa: E402

C = lm.Config
# Rows per CTA x warpgroups per CTA (one vocab tile each) x pipeline depth x hidden columns
# per pipeline step (x hidden rows in place: the logits only).
CONFIGS = [
    C(tile_m=64, num_wgs=2, max_concurrent_steps=4, hidden_in_place=True),
    C(tile_m=64, num_wgs=1, max_concurrent_steps=4, tile_k=128, hidden_in_place=True),
    C(tile_m=64, num_wgs=2, max_concurrent_steps=4),
    C(tile_m=64, num_wgs=1, max_concurrent_steps=4),
    C(tile_m=64, num_wgs=1, max_concurrent_steps=8),
    C(tile_m=64, num_wgs=1, max_concurrent_steps=4, tile_k=128),
    C(tile_m=64, num_wgs=1, max_concurrent_steps=6, tile_k=128),
    C(tile_m=128, num_wgs=2, max_concurrent_steps=4),
    C(tile_m=128, num_wgs=1, max_concurrent_steps=6),
]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", default="1,8,64,256", help="comma-separated T")
  ap.add_argument("--hidden", default="896,4096", help="comma-separated H")
  ap.add_argument("--vocab", type=int, default=151936)
  ap.add_argument("--hbm", type=float, default=3.35, help="HBM TB/s of the floor column")
  ap.add_argument("--layout", default="hv", choices=("hv", "vh"),
                  help="the weight: [H, V] (hv) or a tied embedding's [V, H] (vh)")
  args = ap.parse_args()
  kw = dict(layout=args.layout, temperature=1.0, compute_dtype=jnp.bfloat16)
  seed = draw.seed_words(jax.random.key(3))
  print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; V = {args.vocab}; "
        f"weight layout {args.layout!r}; us per call")
  for hidden in (int(x) for x in args.hidden.split(",")):
    w = head_weight(jax.random.key(0), hidden, args.vocab, args.layout, 0.02)
    floor_us = hidden * args.vocab * 2 / (args.hbm * 1e12) * 1e6
    for t in (int(x) for x in args.rows.split(",")):
      x = jax.random.normal(jax.random.key(t), (t, hidden), jnp.bfloat16)
      stock = jax.jit(lambda x, w: jax.nn.log_softmax(head_product(x, w, args.layout), axis=-1))
      stock_us = device_ms(stock, x, w) * 1e3
      print(f"== T={t} H={hidden}: stock logits + log_softmax {stock_us:.1f} us, "
            f"floor {floor_us:.1f} us", flush=True)
      for kind in ("logits", "draw"):
        if kind == "logits":
          def run(x, w, cfg):
            return lm.logits(x, w, None, return_stats=True, config=cfg, **kw)
        else:
          def run(x, w, cfg):
            return lm.logits_draw(x, w, None, seed, config=cfg, **kw)
        default = jax.jit(lambda x, w, run=run: run(x, w, None))
        want = bits_digest(default(x, w))
        us = device_ms(default, x, w) * 1e3
        print(f"  {kind:6s} default  {us:8.1f} us  stock/this {stock_us / us:5.2f}x", flush=True)
        for cfg in CONFIGS:
          if cfg.hidden_in_place and kind == "draw":
            continue  # the draw reads its rows padded
          try:
            f = jax.jit(lambda x, w, cfg=cfg, run=run: run(x, w, cfg))
            same = bits_digest(f(x, w)) == want
            us = device_ms(f, x, w) * 1e3
            print(f"  {kind:6s} {us:8.1f} us  stock/this {stock_us / us:5.2f}x  "
                  f"bits={'same' if same else 'DIFFERENT'}  {cfg}", flush=True)
          except Exception as e:  # noqa: BLE001 - a sweep report
            print(f"  {kind:6s} FAIL {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
  main()
