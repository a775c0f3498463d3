"""Rollout throughput at real model shapes: jaxrl_kernels vs the stock XLA path, one process.

N prompts x P random prompt tokens, G new tokens sampled at temperature 1 with
``nn.sample`` (prefill, then one decode step per token on the KV cache), for a
random-weight preset model. Both paths hold the same weights:

* ``jaxrl_kernels``: ``implementation=None`` (``det_matmul``, ``causal_attention``,
  the LM head's logits with in-kernel row statistics);
* ``stock``: ``implementation="xla"`` (``jnp.dot``, ``jax.nn.dot_product_attention``
  with cuDNN, materialised logits + log-softmax, ``jax.random.categorical``).

Timing is pipelined: ``--repeats`` calls enqueued back to back, one block at the
end. Reported: generated tokens/s (N G / time per call), the per-step decode
latency ``(t(G) - t(1)) / (G - 1)`` (t(1): prefill + one head pass), and, with
``--check``, how many sampled tokens' log-probs differ from the trainer's
recomputation (``nn.score``, packed, another batch size): 0 expected for
jaxrl_kernels; the stock path's count and max drift are shown next to it.

    python benchmarks/rollout.py --preset qwen2.5-0.5b --prompts 64 --prompt-len 512 \\
        --new-tokens 1024 --out benchmarks/results/rollout.md
    python benchmarks/rollout.py --preset qwen2.5-0.5b --layers 2 --prompts 4 \\
        --prompt-len 32 --new-tokens 16 --repeats 1     # smoke size
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

from jaxrl_kernels._backend import no_fma_xla_flags

# Before JAX starts its backends: on the CPU, XLA contracts ``a * b + c`` into one FMA
# where its fusion puts the two together, which differs between the decode step and the
# trainer's forward for the model's element-wise maths (rotary, RMSNorm); the test suite
# and ``python -m jaxrl_kernels`` run without it too. No effect on GPU code.
os.environ["XLA_FLAGS"] = no_fma_xla_flags()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_kernels import models  # noqa: E402
from jaxrl_kernels.models.decoder import DecoderLM  # noqa: E402
from jaxrl_kernels.nn import logp_from_stats  # noqa: E402
from jaxrl_kernels.nn.sampler import cache_length, draw, sample, score  # noqa: E402
from jaxrl_kernels.pallas import draw as race  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import breakdown_lines, kernel_breakdown, per_step  # noqa: E402


def with_implementation(model: DecoderLM, implementation: str | None) -> DecoderLM:
  """The same parameters (shared arrays, no copy) and row chunks under another
  implementation."""
  cfg = model.config
  pdt = model.embed_tokens.embedding.get_value().dtype
  abstract = nnx.eval_shape(lambda: DecoderLM(cfg, dtype=model.dtype, param_dtype=pdt,
                                              implementation=implementation,
                                              remat=model.remat, row_chunks=model.row_chunks,
                                              rngs=nnx.Rngs(0)))
  graphdef, _ = nnx.split(abstract)
  return nnx.merge(graphdef, nnx.state(model))


def parse_overrides(items: list[str]) -> list[tuple[str, int]]:
  """``["vocab_size=512", ...]`` -> ``[("vocab_size", 512), ...]``."""
  out = []
  for item in items:
    name, _, value = item.partition("=")
    if not value.lstrip("-").isdigit():
      raise ValueError(f"--set wants FIELD=INT, got {item!r}")
    out.append((name, int(value)))
  return out


def add_model_args(ap: argparse.ArgumentParser) -> None:
  """The model-choice flags shared with train_step.py."""
  ap.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(models.PRESETS))
  ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
  ap.add_argument("--set", action="append", default=[], metavar="FIELD=INT",
                  help="override a config field, e.g. --set vocab_size=512 (smoke runs)")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--row-chunks", type=int, default=None,
                  help="DecoderLM row_chunks of o/down (default: the model's "
                       "canonical_row_chunks, TP-invariant; 1: one det_matmul, TP = 1 only)")


def preset_model(args, **kw) -> DecoderLM:
  """The preset of ``args`` with random weights, ``--layers`` and ``--set`` applied."""
  over = dict(parse_overrides(args.set))
  if args.layers is not None:
    over["num_hidden_layers"] = args.layers
  if args.row_chunks is not None:
    kw["row_chunks"] = args.row_chunks
  return models.preset(args.preset, jax.random.key(0), args.dtype, **kw, **over)


_START = time.perf_counter()


def progress(message: str) -> None:
  """A time-stamped line on stderr (long runs show where they are)."""
  print(f"[{time.perf_counter() - _START:7.1f} s] {message}", file=sys.stderr, flush=True)


def _timed(fn, repeats: int, what: str) -> float:
  """Seconds per call, pipelined (enqueue ``repeats`` calls, block once)."""
  progress(f"{what}: compile + warm-up call")
  jax.block_until_ready(fn())
  progress(f"{what}: {repeats} timed calls")
  t0 = time.perf_counter()
  outs = [fn() for _ in range(repeats)]
  jax.block_until_ready(outs)
  return (time.perf_counter() - t0) / repeats


def decode_loop(model: DecoderLM, prompts, lens, new_tokens: int, fused_draw: bool = True):
  """``f(n)``: one jitted executable running the prefill, then a ``fori_loop`` of ``n``
  decode steps (``n`` traced: one compilation for every ``n``), the loop body as the
  sampler's (sampler head, draw and ``decode_step``, the cache carried in the loop and updated
  in place; the kernel head's statistics merge, once per chunk of
  ``nn.sampler.SAMPLER_CHUNK`` steps in the sampler, is left out). The cache is the
  sampler's (prompt + ``new_tokens`` slots, aligned); the steps run right after the prompt.
  Differences between ``f(1 + k)`` and ``f(1)`` are ``k`` decode steps of one executable."""
  graphdef, state = nnx.split(model)
  b, p = prompts.shape

  def draw_at(i, logits):
    return draw(jax.random.fold_in(jax.random.key(0), i), logits)

  @jax.jit
  def rollout(state, prompts, lens, n):
    m = nnx.merge(graphdef, state)
    h, cache = m.prefill(prompts, lens, m.init_cache(b, cache_length(p + new_tokens)))
    weights = m.decode_weights()  # once, before the loop, as the sampler does

    def body(i, carry):
      h, cache, total = carry
      kernel_head = m.head.implementation != "xla"
      if kernel_head and fused_draw:  # the draw in the head's pass (the sampler's default)
        tok, tz, stats = m.head.draw_partials(
            h, race.seed_words(jax.random.fold_in(jax.random.key(0), i)), temperature=1.0)
        total = total + tz + stats.s[0]
        h, cache = m.decode_step(tok, cache, weights=weights)
        return h, cache, total
      parts = m.head.logits_partials(h, temperature=1.0) if kernel_head else None
      if parts is None:  # the stock path: logits + log-softmax every step
        logits, stats = m.head.logits(h, temperature=1.0, return_stats=True)
        total = total + logp_from_stats(logits, stats, draw_at(i, logits))
      else:  # the sampler merges the statistics once per chunk of steps (not counted here)
        logits, stats = parts
        total = total + stats.s[0]
      tok = draw_at(i, logits)
      h, cache = m.decode_step(tok, cache, weights=weights)
      return h, cache, total

    return jax.lax.fori_loop(0, n, body, (h, cache, jnp.zeros((b,), jnp.float32)))[2]

  return lambda n: rollout(state, prompts, lens, jnp.int32(n))


def step_kernels(model: DecoderLM, prompts, lens, new_tokens: int, steps: int = 8,
                 fused_draw: bool = True):
  """The kernels of one decode step of :func:`decode_loop` (its CUPTI breakdown at
  ``1 + steps`` steps minus the one at 1 step, per kernel name, per step), or None without
  CUPTI."""
  f = decode_loop(model, prompts, lens, new_tokens, fused_draw)
  return per_step(kernel_breakdown(f, 1), kernel_breakdown(f, 1 + steps), steps)


def run(model: DecoderLM, prompts, lens, *, new_tokens: int, repeats: int, check: bool,
        score_batch: int, profile: bool = False, fused_draw: bool = True) -> dict:
  key = jax.random.key(0)
  kw = dict(key=key, fused_draw=fused_draw)
  t_g = _timed(lambda: sample(model, prompts, lens, max_new_tokens=new_tokens, **kw),
               repeats, f"rollout of {new_tokens} tokens")
  t_1 = _timed(lambda: sample(model, prompts, lens, max_new_tokens=1, **kw), repeats,
               "prefill + 1 token")
  row = {"s_per_rollout": t_g, "tok_s": prompts.shape[0] * new_tokens / t_g,
         "step_ms": 1e3 * (t_g - t_1) / max(new_tokens - 1, 1), "prefill_ms": 1e3 * t_1}
  # Printed now: a check that runs out of the call's time keeps the timings.
  progress(f"timed: {row['tok_s']:.0f} tokens/s, {row['step_ms']:.3f} ms per decode step, "
           f"prefill + 1 {row['prefill_ms']:.1f} ms")
  if profile:
    progress("kernel breakdown of one decode step (CUPTI)")
    row["kernels"] = step_kernels(model, prompts, lens, new_tokens, fused_draw=fused_draw)
  if check:
    progress("sampler == trainer check")
    res = sample(model, prompts, lens, max_new_tokens=new_tokens, **kw)
    got = score(model, res.tokens, res.completion_mask, batch_size=score_batch, pack=True)
    lp = np.asarray(res.logp)
    m = np.asarray(res.completion_mask)
    diff = got.view(np.uint32) != lp.view(np.uint32)
    row["mismatched"] = int(np.sum(diff & m))
    row["checked"] = int(m.sum())
    row["max_drift"] = float(np.max(np.abs(got - lp)[m])) if m.any() else 0.0
  return row


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_model_args(ap)
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--prompt-len", type=int, default=512)
  ap.add_argument("--new-tokens", type=int, default=1024)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--score-batch", type=int, default=8, help="rows per trainer forward")
  ap.add_argument("--no-check", action="store_true", help="skip the sampler == trainer check")
  ap.add_argument("--profile", action="store_true",
                  help="append each path's per-kernel breakdown of one decode step (CUPTI)")
  ap.add_argument("--top", type=int, default=15, help="longest kernels listed per path")
  ap.add_argument("--only", choices=("kernels", "stock"), default=None)
  ap.add_argument("--draw", choices=("head", "logits", "both"), default="head",
                  help="our path's draw: in the head's pass (nn.sample's default), from "
                       "stored logits (fused_draw=False), or both in one process")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  model = preset_model(args)
  cfg = model.config
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, cfg.vocab_size, (args.prompts, args.prompt_len)).astype(np.int32)
  lens = np.full((args.prompts,), args.prompt_len, np.int32)
  # name: (implementation, fused draw)
  paths = {"jaxrl_kernels": (None, args.draw != "logits"), "stock (xla)": ("xla", False)}
  if args.draw == "both":
    paths = {"jaxrl_kernels": (None, True), "jaxrl_kernels (logits draw)": (None, False),
             "stock (xla)": ("xla", False)}
  if args.only:
    paths = {k: v for k, v in paths.items() if (v[0] is None) == (args.only == "kernels")}
  rows = {}
  for name, (impl, fused) in paths.items():
    progress(name)
    m = with_implementation(model, impl)
    rows[name] = run(m, prompts, lens, new_tokens=args.new_tokens, repeats=args.repeats,
                     check=not args.no_check, score_batch=args.score_batch,
                     profile=args.profile, fused_draw=fused)
    print(name, {k: v for k, v in rows[name].items() if k != "kernels"}, flush=True)
  device = jax.devices()[0].device_kind
  lines = [
      f"# Rollout: {args.preset} shape, {cfg.num_hidden_layers} layers, {args.dtype}, "
      f"row-parallel chunks (o_proj, down_proj) {model.row_parallel_chunks}", "",
      f"device {device}; jax {jax.__version__}; {datetime.date.today().isoformat()}; "
      f"{args.prompts} prompts x {args.prompt_len} tokens + {args.new_tokens} new tokens, "
      f"temperature 1; pipelined over {args.repeats} calls; our draw: {args.draw}.", "",
      "| path | tokens/s | per-step decode (ms) | prefill + 1 (ms) | sampler logp != trainer "
      "| max drift |",
      "|---|---|---|---|---|---|",
  ]
  for name, r in rows.items():
    mism = f"{r['mismatched']} / {r['checked']}" if "mismatched" in r else "-"
    drift = f"{r['max_drift']:.2e}" if "max_drift" in r else "-"
    lines.append(f"| {name} | {r['tok_s']:.0f} | {r['step_ms']:.3f} | {r['prefill_ms']:.1f} | "
                 f"{mism} | {drift} |")
  if "jaxrl_kernels" in rows and "stock (xla)" in rows:
    k, s = rows["jaxrl_kernels"], rows["stock (xla)"]
    lines += ["", f"jaxrl_kernels / stock tokens/s: {k['tok_s'] / s['tok_s']:.3f}x; per-step "
              f"latency ratio {k['step_ms'] / s['step_ms']:.3f}."]
    if "jaxrl_kernels (logits draw)" in rows:
      g = rows["jaxrl_kernels (logits draw)"]
      lines += [f"jaxrl_kernels (logits draw) / stock tokens/s: {g['tok_s'] / s['tok_s']:.3f}x; "
                f"per-step latency ratio {g['step_ms'] / s['step_ms']:.3f}."]
  if args.profile:
    for name, r in rows.items():
      lines += breakdown_lines(f"{name}: one decode step", r.get("kernels"), args.top)
  table = "\n".join(lines) + "\n"
  print(table)
  if args.out:
    with open(args.out, "w") as f:
      f.write(table)
  k = rows.get("jaxrl_kernels")
  if k is not None and k.get("mismatched", 0):
    print(f"FAILED: {k['mismatched']} sampled tokens' log-probs differ from the trainer's",
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
