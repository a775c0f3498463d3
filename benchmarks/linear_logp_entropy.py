"""``linear_logp`` with and without the entropy, at the Qwen2.5-0.5B training step's head.

T = 16384 packed tokens, H = 896, V = 151936, a tied ``[V, H]`` bf16 weight, the Mosaic
backend. Rows: the fused forward's kernel (``linear_logp_mosaic.tile_partials``) with
``entropy`` True and False, and the op's forward+backward (``jax.value_and_grad`` of a
weighted sum of logp) with ``return_entropy`` True (entropy unused) and False, interleaved
A/B for three rounds (CUPTI device time, median); then each forward+backward's longest
kernels.

    PYTHONPATH=$PWD python benchmarks/linear_logp_entropy.py
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import device_ms, kernel_breakdown  # noqa: E402

from jaxrl_kernels.linear_logp import linear_logp  # noqa: E402
from jaxrl_kernels.pallas import linear_logp_mosaic as lm  # noqa: E402

T, H, V = 16384, 896, 151936


def main() -> int:
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  ks = jax.random.split(jax.random.key(1), 4)
  h = (jax.random.normal(ks[0], (T, H), jnp.float32) * 0.5).astype(jnp.bfloat16)
  w = (jax.random.normal(ks[1], (V, H), jnp.float32) * 0.05).astype(jnp.bfloat16)
  tg = jax.random.randint(ks[2], (T,), 0, V)
  gl = jax.random.normal(ks[3], (T,))
  kw = dict(layout="vh", temperature=1.0, compute_dtype=jnp.bfloat16)
  fwd = {e: jax.jit(lambda h, w, tg, e=e: lm.tile_partials(h, w, None, tg, entropy=e, **kw))
         for e in (True, False)}
  fb = {}
  for ent in (True, False):
    def loss(h, w, ent=ent):
      out = linear_logp(h, w, tg, weight_layout="vh", return_entropy=ent,
                        implementation="mosaic")
      return jnp.sum((out[0] if ent else out) * gl)
    fb[ent] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  for rnd in range(3):
    for e in (True, False):
      print(f"round {rnd} fwd tile_partials entropy={e}: {device_ms(fwd[e], h, w, tg):.3f} ms",
            flush=True)
    for e in (True, False):
      print(f"round {rnd} fwd+bwd return_entropy={e}: "
            f"{device_ms(fb[e], h, w, iterations=5):.3f} ms", flush=True)
  for e in (True, False):
    agg: dict[str, list[float]] = {}
    for kn, t in kernel_breakdown(fb[e], h, w) or ():
      agg.setdefault(kn[:48], []).append(t)
    print(f"fwd+bwd return_entropy={e} kernels:")
    for kn, ts in sorted(agg.items(), key=lambda kv: -sum(kv[1]))[:5]:
      print(f"   {sum(ts):8.3f} ms {len(ts):4d} calls {1e3 * sum(ts) / len(ts):8.1f} us  {kn}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
