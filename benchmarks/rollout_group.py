"""GRPO group rollout: each prompt prefilled once for its G completions, vs G repeated rows.

    python benchmarks/rollout_group.py --preset qwen2.5-0.5b --prompts 32 --group 8 \\
        --prompt-len 1024 --new-tokens 256 --out benchmarks/results/rollout_group_h200.md

For a random-weight preset model (bf16): ``nn.sample(model, prompts, lengths,
num_samples=G)`` (one prefill of ``N`` prompts, the cache rows repeated for the ``N G``
completions) against ``nn.sample(model, repeat(prompts, G), ...)`` (``N G`` prefills), and
the prefill alone in one pass and in chunks (``prefill_chunk``). Times: ``--repeats`` calls
enqueued back to back, one block at the end, per call. The tokens and log-probs of the
grouped call are checked bitwise against the repeated one's (and the chunked prefill's
against the one-pass prefill's).
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_kernels import models
from jaxrl_kernels.nn.sampler import cache_length, sample


def _time(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # compile
  t0 = time.perf_counter()
  outs = [fn() for _ in range(repeats)]
  jax.block_until_ready(outs)
  return (time.perf_counter() - t0) / repeats * 1e3


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(models.PRESETS))
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--prompts", type=int, default=32)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=1024)
  ap.add_argument("--new-tokens", type=int, default=256)
  ap.add_argument("--chunk", type=int, default=256, help="prefill chunk for the chunked row")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default=None)
  a = ap.parse_args()
  over = {} if a.layers is None else {"num_hidden_layers": a.layers}
  model = models.preset(a.preset, 0, "bfloat16", **over)
  rng = np.random.default_rng(0)
  v = model.config.vocab_size
  prompts = jnp.asarray(rng.integers(0, v, (a.prompts, a.prompt_len)), jnp.int32)
  lengths = jnp.full((a.prompts,), a.prompt_len, jnp.int32)
  key = jax.random.key(1)
  kw = dict(max_new_tokens=a.new_tokens, key=key)
  rep_p, rep_l = jnp.repeat(prompts, a.group, 0), jnp.repeat(lengths, a.group, 0)
  grouped = lambda: sample(model, prompts, lengths, num_samples=a.group, **kw)  # noqa: E731
  repeated = lambda: sample(model, rep_p, rep_l, **kw)  # noqa: E731
  g, r = grouped(), repeated()
  bits = lambda x: np.asarray(x).view(np.uint32)  # noqa: E731
  same = (np.array_equal(np.asarray(g.tokens), np.asarray(r.tokens))
          and np.array_equal(bits(g.logp), bits(r.logp)))
  t_group = _time(grouped, a.repeats)
  t_rep = _time(repeated, a.repeats)
  total = cache_length(a.prompt_len + a.new_tokens)

  @nnx.jit(static_argnames=("chunk", "rows"))
  def prefill(m, p, lens, chunk, rows):
    return m.prefill(p, lens, m.init_cache(rows, total), chunk=chunk)

  one = lambda: prefill(model, rep_p, rep_l, None, rep_p.shape[0])  # noqa: E731
  once = lambda: prefill(model, prompts, lengths, None, prompts.shape[0])  # noqa: E731
  chunked = lambda: prefill(model, prompts, lengths, a.chunk, prompts.shape[0])  # noqa: E731
  h1, c1 = once()
  h2, c2 = chunked()
  chunk_same = np.array_equal(np.asarray(h1).view(np.uint16), np.asarray(h2).view(np.uint16))
  chunk_same &= all(np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
                    for x, y in zip(c1.keys + c1.values, c2.keys + c2.values))
  t_pre_rep, t_pre_once, t_pre_chunk = (_time(f, a.repeats) for f in (one, once, chunked))
  dev = jax.devices()[0]
  rows = a.prompts * a.group
  text = "\n".join([
      f"# GRPO group rollout ({a.preset}, bf16)", "",
      f"device: {dev.device_kind}; jax {jax.__version__}; {datetime.date.today().isoformat()}; "
      f"{a.prompts} prompts x G={a.group}, prompt {a.prompt_len} tokens, {a.new_tokens} new "
      f"tokens, layers {model.config.num_hidden_layers}",
      f"command: python benchmarks/rollout_group.py --preset {a.preset} --prompts {a.prompts} "
      f"--group {a.group} --prompt-len {a.prompt_len} --new-tokens {a.new_tokens} "
      f"--chunk {a.chunk}", "",
      "| what | ms per call | vs repeated rows | bitwise |",
      "|---|---|---|---|",
      f"| sample, {rows} repeated rows | {t_rep:.1f} | 1.00x | reference |",
      f"| sample(num_samples={a.group}), {a.prompts} prefills | {t_group:.1f} | "
      f"{t_group / t_rep:.2f}x | {'yes' if same else 'NO'} |",
      f"| prefill of {rows} rows | {t_pre_rep:.1f} | 1.00x | |",
      f"| prefill of {a.prompts} prompts (shared by the group) | {t_pre_once:.1f} | "
      f"{t_pre_once / t_pre_rep:.2f}x | |",
      f"| prefill of {a.prompts} prompts in chunks of {a.chunk} | {t_pre_chunk:.1f} | "
      f"{t_pre_chunk / t_pre_rep:.2f}x | {'yes' if chunk_same else 'NO'} (vs one pass) |",
      ""])
  print(text)
  if a.out:
    with open(a.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
