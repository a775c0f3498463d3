"""The sampler's LM-head decode step against XLA's logits + log-softmax, at decode row counts.

One sampler step of the head: float32 logits of ``T`` hidden rows (``T`` = the rollout batch)
and each row's log-prob of a drawn token.

* ``jaxrl_kernels``: ``head_logits(h, W, return_stats=True)`` (the logits with in-kernel row
  statistics, the fused op's own kernel) then ``logp_from_stats``: log-probs bitwise the
  trainer's ``linear_logp`` (checked here, column "logp == trainer");
* ``merge deferred``: ``head_logits_partials`` and the target logit, the per-step part of
  ``nn.sample``, which merges the per-tile statistics once per chunk of steps (the merge is
  a sequential fold over the vocabulary tiles: its latency does not shrink with the rows);
* ``stock``: the float32 product ``h W`` of the same weight array (``_timing.head_product``),
  ``jax.nn.log_softmax``, the target's entry.

Timing is pipelined: ``--calls`` calls enqueued back to back (rotating over enough copies of
``h`` that each call reads its rows afresh), one block at the end; the ratio is stock time /
ours (>= 0.95 is the target). The kernel columns time the merge-deferred step and stock by
CUPTI (the sum of all the kernels a call launches, host dispatch left out; the minimum of
three alternating rounds). ``--layout vh`` takes a tied embedding's ``[V, H]`` weight. The
floor is the weight read plus the logits write at ``--hbm`` TB/s (the FLOPs, ``2 T H V``,
are far below the tensor cores' rate at these T).

    python benchmarks/head_decode.py --out benchmarks/results/head_decode.md
    python benchmarks/head_decode.py --rows 1,8 --hidden 64 --vocab 1000 --calls 3   # smoke
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels.linear_logp import linear_logp
from jaxrl_kernels.nn import head_logits, logp_from_stats
from jaxrl_kernels.nn.lm_head import head_logits_partials

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_ms, head_product, head_sweep, head_weight, pipelined_ms  # noqa: E402


def _ours(implementation, layout):
  def step(h, w, tok):
    logits, stats = head_logits(h, w, return_stats=True, weight_layout=layout,
                                implementation=implementation)
    return logits, logp_from_stats(logits, stats, tok)
  return jax.jit(step)


def _ours_deferred(implementation, layout):
  """The per-step part when the sampler merges the statistics once per chunk of steps
  (``nn.sample``): the logits, their per-tile statistics and the target logit."""
  def step(h, w, tok):
    logits, parts = head_logits_partials(h, w, weight_layout=layout,
                                         implementation=implementation)
    return logits, parts, jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0]
  return jax.jit(step)


def _stock(layout):
  def step(h, w, tok):
    logits = head_product(h, w, layout)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return logits, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
  return jax.jit(step)


def measure(t: int, hidden: int, vocab: int, *, calls: int, implementation,
            layout: str = "hv") -> dict:
  """One shape: both paths' time per call and the bitwise check against the trainer."""
  k = jax.random.split(jax.random.key(t), 3)
  w = head_weight(k[0], hidden, vocab, layout, 0.02)
  hs = [jax.random.normal(jax.random.fold_in(k[1], i), (t, hidden), jnp.bfloat16)
        for i in range(4)]
  tok = jax.random.randint(k[2], (t,), 0, vocab)
  ours = _ours(implementation, layout)
  deferred = _ours_deferred(implementation, layout)
  stock = _stock(layout)
  sets = [(h, w, tok) for h in hs]
  row = {"t": t, "h": hidden, "v": vocab,
         "ours_ms": pipelined_ms(ours, sets, calls),
         "deferred_ms": pipelined_ms(deferred, sets, calls),
         "stock_ms": pipelined_ms(stock, sets, calls)}
  # Kernel time (CUPTI: the sum of every kernel a call launches, host dispatch left out),
  # the minimum of three rounds alternating the two.
  rounds = [(device_ms(deferred, *sets[0]), device_ms(stock, *sets[0])) for _ in range(3)]
  row["deferred_kernel_ms"] = min(r[0] for r in rounds)
  row["stock_kernel_ms"] = min(r[1] for r in rounds)
  trainer = jax.jit(lambda h, w, tok: linear_logp(h, w, tok, weight_layout=layout,
                                                  implementation=implementation))
  lp = np.asarray(ours(hs[0], w, tok)[1])
  row["bitwise"] = bool(np.array_equal(lp.view(np.uint32),
                                       np.asarray(trainer(hs[0], w, tok)).view(np.uint32)))
  return row


def table(rows: list[dict], hbm_tbs: float) -> list[str]:
  lines = ["| T | H | V | jaxrl_kernels (ms) | merge deferred (ms) | stock (ms) | stock / ours "
           "| stock / deferred | kernels: deferred / stock (us) | stock / deferred, kernels "
           "| floor (ms) | logp == trainer |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    floor_bytes = r["h"] * r["v"] * 2 + r["t"] * r["v"] * 4
    floor = floor_bytes / (hbm_tbs * 1e12) * 1e3
    lines.append(f"| {r['t']} | {r['h']} | {r['v']} | {r['ours_ms']:.3f} | "
                 f"{r['deferred_ms']:.3f} | {r['stock_ms']:.3f} | "
                 f"{r['stock_ms'] / r['ours_ms']:.2f}x | {r['stock_ms'] / r['deferred_ms']:.2f}x | "
                 f"{1e3 * r['deferred_kernel_ms']:.1f} / {1e3 * r['stock_kernel_ms']:.1f} | "
                 f"{r['stock_kernel_ms'] / r['deferred_kernel_ms']:.3f}x | {floor:.3f} | "
                 f"{'yes' if r['bitwise'] else '**no**'} |")
  return lines


def main() -> None:
  head_sweep(__doc__.splitlines()[0], measure, table, rows="1,8,64,256", hidden="896,4096",
             hbm=3.0, title="LM-head decode step",
             caption="bf16 hidden and weight, float32 logits; {calls} calls pipelined per "
                     "timing; floor = weight read + logits write at {hbm} TB/s.")


if __name__ == "__main__":
  main()
