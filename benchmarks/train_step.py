"""Training-step throughput and memory at real model shapes: jaxrl_kernels vs stock XLA.

A packed batch of ``--tokens`` tokens (rows of ``--row-len`` tokens, documents of
random lengths packed first-fit with ``segment_ids`` and restarting positions),
one step = forward + backward through ``model.logp`` (the mean negative
log-prob of the next token) + an optax AdamW update, jitted with the parameters
and optimizer state donated. Both paths hold the same weights:

* ``jaxrl_kernels``: ``implementation=None`` (fused LM head: no ``[T, V]`` logits);
* ``stock``: ``implementation="xla"`` (``jnp.dot``, ``jax.nn.dot_product_attention``
  with cuDNN, materialised logits + log-softmax).

Reported: tokens/s (pipelined: after two warm-up steps, ``--repeats`` steps enqueued, one
block), and the
compiled step's memory (``memory_analysis``: arguments + temporaries + outputs
not aliased to donated inputs), the peak the step needs.

    python benchmarks/train_step.py --preset qwen2.5-0.5b --tokens 16384 \\
        --out benchmarks/results/train_step.md
    python benchmarks/train_step.py --preset qwen2.5-0.5b --layers 2 --tokens 512 \\
        --row-len 256 --repeats 1                       # smoke size
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl_kernels.models.decoder import DecoderLM

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import breakdown_lines, kernel_breakdown  # noqa: E402
from rollout import add_model_args, preset_model, progress, with_implementation  # noqa: E402


def packed_batch(n_tokens: int, row_len: int, vocab: int, seed: int = 0) -> dict:
  """``[n_tokens / row_len, row_len]`` rows of documents (lengths uniform in
  ``[row_len / 8, row_len]``), packed in order; unused tail tokens are masked padding."""
  if n_tokens % row_len:
    raise ValueError(f"--tokens ({n_tokens}) must be a multiple of --row-len ({row_len})")
  rng = np.random.default_rng(seed)
  rows = n_tokens // row_len
  shape = (rows, row_len)
  tokens = rng.integers(0, vocab, shape).astype(np.int32)
  positions = np.full(shape, -1, np.int32)
  segments = np.zeros(shape, np.int32)
  n_docs = 0
  for r in range(rows):
    col, seg = 0, 1
    while col < row_len:
      n = min(int(rng.integers(row_len // 8, row_len + 1)), row_len - col)
      positions[r, col:col + n] = np.arange(n)
      segments[r, col:col + n] = seg
      col, seg, n_docs = col + n, seg + 1, n_docs + 1
  targets = np.roll(tokens, -1, axis=1)
  # A document's last token has no next token in it.
  nxt_pos = np.roll(positions, -1, axis=1)
  mask = (positions >= 0) & (nxt_pos == positions + 1)
  mask[:, -1] = False
  return dict(tokens=tokens, targets=targets, mask=mask, positions=positions,
              segment_ids=segments, max_docs=n_docs)


def make_loss(graphdef, rest, max_docs: int):
  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params, rest)
    lp = model.logp(batch["tokens"], batch["targets"], batch["mask"],
                    positions=batch["positions"], segment_ids=batch["segment_ids"],
                    max_docs=max_docs)
    return -jnp.sum(lp) / jnp.maximum(jnp.sum(batch["mask"]), 1)

  return loss_fn


def make_step(graphdef, rest, tx, max_docs: int):
  loss_fn = make_loss(graphdef, rest, max_docs)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def run(model: DecoderLM, batch: dict, *, repeats: int, profile: bool = False) -> dict:
  max_docs = batch.pop("max_docs")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = jax.tree.map(lambda x: x.copy(), params)  # donated: keep the caller's arrays
  tx = optax.adamw(1e-5)
  opt_state = tx.init(params)
  step = make_step(graphdef, rest, tx, max_docs)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  progress(f"compiling the step ({int(np.prod(batch['tokens'].shape))} tokens)")
  compiled = step.lower(params, opt_state, batch).compile()
  progress("compiled; two warm-up steps")
  mem = compiled.memory_analysis()
  peak = None
  if mem is not None:
    peak = (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes)
  for _ in range(2):  # warm up: the first executions load kernels and fill the allocator
    params, opt_state, loss = step(params, opt_state, batch)
  jax.block_until_ready(loss)
  progress(f"{repeats} timed steps")
  t0 = time.perf_counter()
  losses = []
  for _ in range(repeats):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(loss)
  jax.block_until_ready(losses)
  dt = (time.perf_counter() - t0) / repeats
  n = int(np.prod(batch["tokens"].shape))
  kernels = None
  if profile:
    progress("kernel breakdown of forward + backward (CUPTI)")
    grad_fn = jax.jit(jax.value_and_grad(make_loss(graphdef, rest, max_docs)))
    kernels = kernel_breakdown(grad_fn, params, batch)
  return {"kernels": kernels, "s_per_step": dt, "tok_s": n / dt,
          "peak_gib": None if peak is None else peak / 2**30,
          "temp_gib": None if mem is None else mem.temp_size_in_bytes / 2**30,
          "loss": float(losses[-1])}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_model_args(ap)
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--row-len", type=int, default=4096)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--remat", action="store_true", help="recompute layer activations")
  ap.add_argument("--profile", action="store_true",
                  help="append each path's per-kernel breakdown of forward + backward (CUPTI)")
  ap.add_argument("--top", type=int, default=15, help="longest kernels listed per path")
  ap.add_argument("--only", choices=("kernels", "stock"), default=None)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  model = preset_model(args, remat=args.remat)
  cfg = model.config
  paths = {"jaxrl_kernels": None, "stock (xla)": "xla"}
  if args.only:
    paths = {k: v for k, v in paths.items() if (v is None) == (args.only == "kernels")}
  rows = {}
  # The stock step first: its temporaries (36.6 GiB at Qwen2.5-0.5B, 16384 tokens) are the
  # larger single allocation, and after ours the allocator's pool (75% of the GPU by
  # default) had no room left for it; ours then reuses the freed region.
  for name, impl in sorted(paths.items(), key=lambda kv: kv[1] is None):
    progress(name)
    batch = packed_batch(args.tokens, args.row_len, cfg.vocab_size)
    try:
      rows[name] = run(with_implementation(model, impl), batch, repeats=args.repeats,
                       profile=args.profile)
    except jax.errors.JaxRuntimeError as e:
      if impl is None:
        raise
      # e.g. ragged_dot's autotuner out of memory at MoE training sizes: a result to report
      rows[name] = {"error": str(e).split("\n")[0][:160]}
    print(name, {k: v for k, v in rows[name].items() if k != "kernels"}, flush=True)
  device = jax.devices()[0].device_kind
  lines = [
      f"# Training step: {args.preset} shape, {cfg.num_hidden_layers} layers, {args.dtype}"
      f"{', remat' if args.remat else ''}, row-parallel chunks (o_proj, down_proj) "
      f"{model.row_parallel_chunks}", "",
      f"device {device}; jax {jax.__version__}; {datetime.date.today().isoformat()}; "
      f"{args.tokens} packed tokens ({args.tokens // args.row_len} rows x {args.row_len}); "
      f"forward + backward through model.logp + optax AdamW; pipelined over {args.repeats} "
      "steps.", "",
      "| path | tokens/s | ms / step | step memory (GiB) | temporaries (GiB) | loss |",
      "|---|---|---|---|---|---|",
  ]
  rows = {name: rows[name] for name in paths}  # the table lists ours first
  for name, r in rows.items():
    if "error" in r:
      lines.append(f"| {name} | fails: {r['error']} | - | - | - | - |")
      continue
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
    temp = "-" if r["temp_gib"] is None else f"{r['temp_gib']:.2f}"
    lines.append(f"| {name} | {r['tok_s']:.0f} | {1e3 * r['s_per_step']:.1f} | {peak} | "
                 f"{temp} | {r['loss']:.4f} |")
  if len(rows) == 2 and not any("error" in r for r in rows.values()):
    k, s = rows["jaxrl_kernels"], rows["stock (xla)"]
    ratio = f"jaxrl_kernels / stock tokens/s: {k['tok_s'] / s['tok_s']:.3f}x"
    if k["peak_gib"] and s["peak_gib"]:
      ratio += f"; step memory {k['peak_gib'] / s['peak_gib']:.3f}x"
    lines += ["", ratio + "."]
  if args.profile:
    for name, r in rows.items():
      if "error" not in r:
        lines += breakdown_lines(f"{name}: forward + backward", r["kernels"], args.top)
  table = "\n".join(lines) + "\n"
  print(table)
  if args.out:
    with open(args.out, "w") as f:
      f.write(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
