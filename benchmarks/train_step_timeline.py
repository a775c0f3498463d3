"""Device timeline of back-to-back training steps: is the GPU ever idle, and where?

``train_step.py`` times a batch of steps from the host (dispatch to the last result); this
script traces ``--steps`` steps after two warm-up steps with ``jax.profiler`` and reads the
GPU plane of the trace: the span from the first kernel's start to the last kernel's end,
the time some kernel runs (busy), and the idle gaps between kernels, summed by the pair of
kernels around each gap. Both paths, the stock one first (as in ``train_step.py``).

    PYTHONPATH=$PWD python benchmarks/train_step_timeline.py --preset qwen2.5-0.5b --tokens 8192
    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python benchmarks/train_step_timeline.py \
        --preset qwen2.5-0.5b --tokens 16384 --steps 1 --launches 30 --sequence 60

``--launches``: the GEMM and attention launches grouped by kernel and launch grid (a
product's calls across layers share one); ``--sequence``: the first launches in order
(a layer's products in the order the step runs them); ``--others``: the other launches
(XLA's fusions, reductions, copies) grouped the same way.

Reads the trace with ``_timing.trace_kernels`` (the profiler's own, private, reader).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import launch_groups, timeline, trace_launches  # noqa: E402
from rollout import add_model_args, preset_model, with_implementation  # noqa: E402
from train_step import make_step, packed_batch  # noqa: E402


def gpu_timeline(trace_dir: str, top: int, launches: int = 0, sequence: int = 0,
                 others: int = 0) -> list[str]:
  """Lines describing the GPU plane of the trace in ``trace_dir``."""
  events = trace_launches(trace_dir)
  if not events:
    return ["  no GPU kernels in the trace"]
  kernels = [(start, end, name) for start, end, name, _ in events]
  t = timeline(kernels)
  lines = [f"  {len(kernels)} kernels, span {t['span'] / 1e6:.3f} ms, busy "
           f"{t['busy'] / 1e6:.3f} ms, idle {(t['span'] - t['busy']) / 1e6:.3f} ms"]
  for pair, ns in t["gaps"].most_common(top):
    lines.append(f"    {ns / 1e6:8.3f} ms in {t['gap_count'][pair]:5d} gaps  {pair}")
  for count, title, classes in (
      (launches, "GEMM and attention launches by kernel and launch grid:", ("GEMM", "attention")),
      (others, "the other launches (elementwise, reductions, copies) by kernel and grid:",
       ("other", "reduction"))):
    if count:
      lines.append(f"  {title}")
      for name, launch, calls, ns in launch_groups(events, classes)[:count]:
        lines.append(f"    {ns / 1e6:8.3f} ms {calls:5d} calls {ns / 1e3 / calls:8.1f} us  "
                     f"{name[:40]}  {launch}")
  if sequence:
    lines.append(f"  the first {sequence} launches in order:")
    for i, (start, end, name, launch) in enumerate(events[:sequence]):
      lines.append(f"    {i:5d} {(end - start) / 1e3:8.1f} us  {name[:40]}  {launch}")
  return lines


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_model_args(ap)
  ap.add_argument("--tokens", type=int, default=8192)
  ap.add_argument("--row-len", type=int, default=4096)
  ap.add_argument("--steps", type=int, default=3, help="steps traced back to back")
  ap.add_argument("--top", type=int, default=12, help="gap pairs listed per path")
  ap.add_argument("--launches", type=int, default=0,
                  help="GEMM/attention launch groups listed per path (0: none)")
  ap.add_argument("--others", type=int, default=0,
                  help="other (non-GEMM, non-attention) launch groups listed per path")
  ap.add_argument("--sequence", type=int, default=0,
                  help="first launches listed in order per path (0: none)")
  args = ap.parse_args(argv)
  model = preset_model(args)
  for name, impl in (("stock (xla)", "xla"), ("jaxrl_kernels", None)):
    batch = packed_batch(args.tokens, args.row_len, model.config.vocab_size)
    max_docs = batch.pop("max_docs")
    graphdef, params, rest = nnx.split(with_implementation(model, impl), nnx.Param, ...)
    params = jax.tree.map(lambda x: x.copy(), params)  # donated: keep the model's arrays
    tx = optax.adamw(1e-5)
    opt_state = tx.init(params)
    step = make_step(graphdef, rest, tx, max_docs)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    for _ in range(2):  # compile and warm up
      params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready(loss)
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
      for _ in range(args.steps):
        params, opt_state, loss = step(params, opt_state, batch)
      jax.block_until_ready(loss)
    print(f"== {name}: {args.steps} steps, {args.tokens} packed tokens", flush=True)
    print("\n".join(gpu_timeline(trace_dir, args.top, args.launches, args.sequence,
                                  args.others)), flush=True)
    del params, opt_state, step
  return 0


if __name__ == "__main__":
  sys.exit(main())
