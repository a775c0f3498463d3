"""Device timeline of decode steps: where a step's wall time goes besides its kernels.

``rollout.py`` times whole rollouts from the host; this script traces one executable of
``rollout.decode_loop`` (prefill, then ``n`` decode steps in a ``fori_loop``) with
``jax.profiler`` at ``n = 1`` and ``n = 1 + --steps``, for both paths, and reports per decode
step (the difference of the two traces over ``--steps``): the span from the first kernel to
the last, the time some kernel runs (busy), the idle time, the kernels' own time and the
time they share (overlap: kernels running at once, which only the stock path's XLA kernels
show), the kernel time per class and per kernel, and the idle gaps by the pair of kernels
around them.

    PYTHONPATH=$PWD XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true \\
        python benchmarks/rollout_timeline.py --preset qwen2.5-0.5b

(``--xla_enable_command_buffers_during_profiling`` keeps XLA's CUDA graphs while tracing, as
in an untraced run; without it the trace runs every kernel on its own launch.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import timeline, trace_kernels  # noqa: E402
from rollout import add_model_args, decode_loop, preset_model, with_implementation  # noqa: E402


def _traced(f, n: int) -> dict:
  trace_dir = tempfile.mkdtemp()
  with jax.profiler.trace(trace_dir):
    jax.block_until_ready(f(n))
  return timeline(trace_kernels(trace_dir))


def per_step_lines(short: dict, long: dict, steps: int, top: int) -> list[str]:
  """The lines of one path: ``long`` minus ``short`` (same executable), per step, in us."""
  def d(key):
    return (long[key] - short[key]) / steps / 1e3

  def diff(counter):
    return {k: (long[counter][k] - short[counter].get(k, 0)) / steps / 1e3
            for k in long[counter]}

  idle = ((long["span"] - long["busy"]) - (short["span"] - short["busy"])) / steps / 1e3
  lines = [f"  span {d('span'):.1f} us, busy {d('busy'):.1f} us, idle {idle:.1f} us, kernel "
           f"time {d('kernel_sum'):.1f} us, overlap {d('overlap'):.1f} us, kernels "
           f"{(long['count'] - short['count']) / steps:.1f}"]
  lines.append("  kernel time by class (us): " + ", ".join(
      f"{k} {v:.1f}" for k, v in sorted(diff("by_class").items())))
  gaps, counts = diff("gaps"), {k: (long["gap_count"][k] - short["gap_count"].get(k, 0)) / steps
                                for k in long["gap_count"]}
  for pair, us in sorted(gaps.items(), key=lambda kv: -kv[1])[:top]:
    lines.append(f"  idle {us:7.2f} us in {counts[pair]:5.1f} gaps  {pair}")
  for name, us in sorted(diff("by_name").items(), key=lambda kv: -kv[1])[:top]:
    lines.append(f"  kernel {us:7.2f} us  {name[:70]}")
  return lines


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_model_args(ap)
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--prompt-len", type=int, default=512)
  ap.add_argument("--new-tokens", type=int, default=1024, help="the cache's decode slots")
  ap.add_argument("--steps", type=int, default=32, help="decode steps traced (and differenced)")
  ap.add_argument("--top", type=int, default=12, help="gap pairs and kernels listed per path")
  args = ap.parse_args(argv)
  model = preset_model(args)
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, model.config.vocab_size,
                         (args.prompts, args.prompt_len)).astype(np.int32)
  lens = np.full((args.prompts,), args.prompt_len, np.int32)
  for name, impl in (("jaxrl_kernels", None), ("stock (xla)", "xla")):
    f = decode_loop(with_implementation(model, impl), prompts, lens, args.new_tokens)
    jax.block_until_ready((f(1), f(1 + args.steps)))  # compiled and warm, before any trace
    short, long = _traced(f, 1), _traced(f, 1 + args.steps)
    print(f"== {name}: per decode step ({args.steps} steps traced; {args.preset}, "
          f"{args.prompts} x {args.prompt_len} prompt tokens)", flush=True)
    print("\n".join(per_step_lines(short, long, args.steps, args.top)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
