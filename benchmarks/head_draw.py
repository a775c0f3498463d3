"""A sampler step's LM-head work with the draw: the draw in the head's kernel against a draw
from stored logits and against the stock path, at rollout row counts.

Per call, for ``T`` hidden rows: a token per row drawn from ``softmax(h W)``, its logit and
what the log-prob needs.

* ``head draw``: ``head_draw_partials`` (on Hopper the race of ``pallas/draw.py`` in the LM
  head's Mosaic epilogue: no logits in memory), the per-step part of ``nn.sample``;
* ``logits + categorical``: ``head_logits_partials`` (float32 logits with in-kernel
  statistics), ``jax.random.categorical`` on them and the token's logit: ``nn.sample``
  with ``fused_draw=False``;
* ``stock``: the float32 product ``h W`` of the same weight array (``_timing.head_product``),
  ``jax.random.categorical``, ``log_softmax`` at the token.

Checked per shape: the head draw's log-probs (merged statistics and the token's logit) are
bitwise ``linear_logp`` of its tokens. Timing is pipelined (``--calls`` calls enqueued back
to back over rotating copies of ``h``, one block at the end). The floor column is the
weight read at ``--hbm`` TB/s. ``--layout vh`` takes a tied embedding's ``[V, H]`` weight.

    python benchmarks/head_draw.py --out benchmarks/results/head_draw_h100.md
    python benchmarks/head_draw.py --rows 4 --hidden 64 --vocab 1000 --calls 3   # smoke
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels.linear_logp import linear_logp
from jaxrl_kernels.linear_logp.logits import (
  LogitPartials,
  head_draw_partials,
  head_logits_partials,
  merge_logit_partials,
)
from jaxrl_kernels.pallas import draw
from jaxrl_kernels.pallas import softmax_partials as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import head_product, head_sweep, head_weight, pipelined_ms  # noqa: E402


def _head_draw(implementation, layout):
  def step(h, w, key):
    return head_draw_partials(h, w, draw.seed_words(key), weight_layout=layout,
                              implementation=implementation)
  return jax.jit(step)


def _logits_draw(implementation, layout):
  def step(h, w, key):
    logits, parts = head_logits_partials(h, w, weight_layout=layout,
                                         implementation=implementation)
    tok = jax.random.categorical(key, logits).astype(jnp.int32)
    return tok, jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0], parts
  return jax.jit(step)


def _stock(layout):
  def step(h, w, key):
    logits = head_product(h, w, layout)
    tok = jax.random.categorical(key, logits)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
  return jax.jit(step)


def measure(t: int, hidden: int, vocab: int, *, calls: int, implementation,
            layout: str = "hv") -> dict:
  k = jax.random.split(jax.random.key(t), 2)
  w = head_weight(k[0], hidden, vocab, layout, 0.05)
  hs = [jax.random.normal(jax.random.fold_in(k[1], i), (t, hidden), jnp.bfloat16)
        for i in range(4)]
  fused = _head_draw(implementation, layout)
  sets = [(h, w, jax.random.key(i)) for i, h in enumerate(hs)]
  row = {"t": t, "h": hidden, "v": vocab,
         "fused_ms": pipelined_ms(fused, sets, calls),
         "logits_ms": pipelined_ms(_logits_draw(implementation, layout), sets, calls),
         "stock_ms": pipelined_ms(_stock(layout), sets, calls)}
  tok, tz, parts = fused(hs[0], w, jax.random.key(0))
  stats = merge_logit_partials(LogitPartials(*parts), implementation=implementation)
  lp, _ = sp.finalize(tz, stats.lse, stats.entropy, tok, None, vocab)
  want = linear_logp(hs[0], w, tok, weight_layout=layout, implementation=implementation)
  row["bitwise"] = bool(np.array_equal(np.asarray(lp).view(np.uint32),
                                       np.asarray(want).view(np.uint32)))
  row["distinct"] = int(len(np.unique(np.asarray(tok))))
  return row


def table(rows: list[dict], hbm_tbs: float) -> list[str]:
  lines = ["| T | H | V | head draw (ms) | logits + categorical (ms) | stock (ms) | "
           "stock / head draw | logits / head draw | floor (ms) | logp == trainer |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    floor = r["h"] * r["v"] * 2 / (hbm_tbs * 1e12) * 1e3
    lines.append(f"| {r['t']} | {r['h']} | {r['v']} | {r['fused_ms']:.3f} | "
                 f"{r['logits_ms']:.3f} | {r['stock_ms']:.3f} | "
                 f"{r['stock_ms'] / r['fused_ms']:.2f}x | {r['logits_ms'] / r['fused_ms']:.2f}x | "
                 f"{floor:.3f} | {'yes' if r['bitwise'] else '**no**'} |")
  return lines


def main() -> None:
  head_sweep(__doc__.splitlines()[0], measure, table, rows="64,256", hidden="896,1536,2048",
             hbm=3.35, title="LM-head draw per sampler step",
             caption="bf16 hidden and weight; {calls} calls pipelined per timing; floor = the "
                     "weight read at {hbm} TB/s.")


if __name__ == "__main__":
  main()
