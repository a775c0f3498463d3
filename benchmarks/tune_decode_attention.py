"""Sweep the Mosaic decode attention's free knobs at rollout shapes against cuDNN; check bits.

A decode step of ``causal_attention`` on Hopper: each KV head's query heads as the rows of
one heads-major block (``attention_mosaic.forward(heads_major=True)``, the GQA fold), one
query per sequence against a cache of ``--cache`` keys. Swept: the K/V ring's depth
(``stages``), decode lanes (batch entries per CTA) and persistent CTAs (one per SM walking
the (batch group, head) items). Every config must give the default's out and lse bits
(compared here). cuDNN is ``jax.nn.dot_product_attention(implementation="cudnn")`` on the
same decode step (``[B, 1, Hq, D]`` against the cache, ``key_value_seq_lengths``). Times are
CUPTI kernel time (``_timing.device_ms``); the floor is the cache's K and V bytes read once
at ``--hbm`` TB/s.

    PYTHONPATH=$PWD python benchmarks/tune_decode_attention.py [--batch 64,256] [--cache 512,1536]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import jax.numpy as jnp

from jaxrl_kernels.pallas import attention_mosaic as am

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import bits_digest, device_ms  # noqa: E402

# (query heads, kv heads, head dim) of the rollout models.
MODELS = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.2-1b": (32, 8, 64), "qwen2.5-1.5b": (12, 2, 128)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", default=",".join(MODELS))
  ap.add_argument("--batch", default="64,256", help="comma-separated B")
  ap.add_argument("--cache", default="512,1024,1536", help="comma-separated keys in the cache")
  ap.add_argument("--stages", default="1,2,3")
  ap.add_argument("--hbm", type=float, default=3.35, help="HBM TB/s of the floor column")
  args = ap.parse_args()
  print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; us per decode step of one "
        "layer")
  for name, bsz, s in itertools.product(args.models.split(","),
                                        (int(x) for x in args.batch.split(",")),
                                        (int(x) for x in args.cache.split(","))):
    hq, hkv, d = MODELS[name]
    group = hq // hkv
    ks = jax.random.split(jax.random.key(bsz + s), 3)
    q = jax.random.normal(ks[0], (bsz, 1, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (bsz, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (bsz, s, hkv, d), jnp.bfloat16)
    kvl = jnp.full((bsz,), s, jnp.int32)
    rows = q.reshape(bsz, hkv, group, d)  # the GQA fold, heads-major (a reshape)
    pos = jnp.full((bsz, group), s - 1, jnp.int32)
    scale = d ** -0.5
    cudnn = jax.jit(lambda q, k, v, kvl, scale=scale: jax.nn.dot_product_attention(
        q, k, v, scale=scale, key_value_seq_lengths=kvl, implementation="cudnn"))
    cudnn_us = device_ms(cudnn, q, k, v, kvl) * 1e3
    floor_us = 2 * bsz * s * hkv * d * 2 / (args.hbm * 1e12) * 1e6
    print(f"== {name} B={bsz} S={s} ({hq}/{hkv} heads, D={d}): cuDNN {cudnn_us:.1f} us, "
          f"floor {floor_us:.1f} us", flush=True)

    def run(q, k, v, pos, kvl, scale=scale, **kw):
      return am.forward(q, k, v, pos, kvl, scale=scale, heads_major=True, **kw)

    default = jax.jit(run)
    want = bits_digest(default(rows, k, v, pos, kvl))
    us = device_ms(default, rows, k, v, pos, kvl) * 1e3
    print(f"  default {us:8.1f} us  {us / cudnn_us:5.2f}x cuDNN  (lanes "
          f"{am.lanes_for(group, bsz, hkv, d)}, {am.STAGES} stages)", flush=True)
    for stages, lanes, persistent in itertools.product(
        (int(x) for x in args.stages.split(",")), (1, 2), (False, True)):
      if lanes == 2 and d > am.LANES_MAX_D:
        continue
      kw = dict(stages=stages, lanes=lanes, persistent=persistent)
      try:
        f = jax.jit(lambda *a, kw=kw: run(*a, **kw))
        same = bits_digest(f(rows, k, v, pos, kvl)) == want
        us = device_ms(f, rows, k, v, pos, kvl) * 1e3
        print(f"  {us:8.1f} us  {us / cudnn_us:5.2f}x cuDNN  bits={'same' if same else 'DIFFERENT'}"
              f"  {kw}", flush=True)
      except Exception as e:  # noqa: BLE001 - a sweep report
        print(f"  FAIL {kw}: {type(e).__name__}: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
  main()
