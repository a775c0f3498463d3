"""Device timeline of back-to-back training steps: is the GPU ever idle, and where?

``train_step.py`` times a batch of steps from the host (dispatch to the last result); this
script traces ``--steps`` steps after two warm-up steps with ``jax.profiler`` and reads the
GPU plane of the trace: the span from the first kernel's start to the last kernel's end,
the time some kernel runs (busy), and the idle gaps between kernels, summed by the pair of
kernels around each gap. Both paths, the stock one first (as in ``train_step.py``).

    PYTHONPATH=$PWD python benchmarks/train_step_timeline.py --preset qwen2.5-0.5b --tokens 8192

Reads the trace through ``jax._src.lib._profile_data`` (the profiler's own reader; a private
module, so this script may need updating with jax).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout import add_model_args, preset_model, with_implementation  # noqa: E402
from train_step import make_step, packed_batch  # noqa: E402


def gpu_timeline(trace_dir: str, top: int) -> list[str]:
  """Lines describing each GPU plane of the trace in ``trace_dir``."""
  from jax._src.lib import _profile_data

  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not files:
    return ["  no trace file written"]
  lines = []
  for plane in _profile_data.ProfileData.from_file(files[0]).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    events = sorted((e.start_ns, e.end_ns, e.name) for line in plane.lines for e in line.events)
    kernels = [e for e in events if not any(w in e[2].lower() for w in ("memcpy", "memset"))]
    if not kernels:
      continue
    busy, cur_start, cur_end, prev = 0, kernels[0][0], kernels[0][1], kernels[0][2]
    gap_ns, gap_count = collections.Counter(), collections.Counter()
    for start, end, name in kernels[1:]:
      if start > cur_end:
        busy += cur_end - cur_start
        pair = f"{prev[:45]} -> {name[:45]}"
        gap_ns[pair] += start - cur_end
        gap_count[pair] += 1
        cur_start, cur_end = start, end
      else:
        cur_end = max(cur_end, end)
      prev = name
    busy += cur_end - cur_start
    span = kernels[-1][1] - kernels[0][0]
    lines.append(f"  {plane.name}: {len(kernels)} kernels, span {span / 1e6:.3f} ms, busy "
                 f"{busy / 1e6:.3f} ms, idle {(span - busy) / 1e6:.3f} ms, "
                 f"{len(events) - len(kernels)} memcpy/memset")
    for pair, ns in gap_ns.most_common(top):
      lines.append(f"    {ns / 1e6:8.3f} ms in {gap_count[pair]:5d} gaps  {pair}")
  return lines or ["  no GPU plane in the trace"]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_model_args(ap)
  ap.add_argument("--tokens", type=int, default=8192)
  ap.add_argument("--row-len", type=int, default=4096)
  ap.add_argument("--steps", type=int, default=3, help="steps traced back to back")
  ap.add_argument("--top", type=int, default=12, help="gap pairs listed per path")
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
    print("\n".join(gpu_timeline(trace_dir, args.top)), flush=True)
    del params, opt_state, step
  return 0


if __name__ == "__main__":
  sys.exit(main())
