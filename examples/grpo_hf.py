"""GRPO on a local Hugging Face folder, bitwise on-policy: text in, rule reward, fused loss.

    python examples/grpo_hf.py --model /path/to/Qwen2.5-0.5B-Instruct --out runs/grpo
    python examples/grpo_hf.py --tiny-folder /tmp/tiny --out /tmp/grpo   # no download: a tiny
                                                                          # random model + tokenizer

A complete loop (needs ``pip install jaxrl_kernels[text]``; the plot needs matplotlib):

1. **Rollout**: a small built-in task (``What is a + b?``, the reward 1 when the completion's
   first number is the sum), prompts through the folder's tokenizer (its chat template when
   it has one), ``G`` completions per prompt with ``nn.sample(..., num_samples=G)`` (each
   prompt prefilled once), decoded to text.
2. **Advantages**: ``rl.group_advantages`` of the rewards within each group.
3. **Update**: ``model.policy_loss`` (the clipped GRPO objective and a k3 KL to the initial
   policy, fused into the LM head) under ``jax.jit`` with the parameters and the optimizer
   state donated, optax AdamW. The sampler reads the new parameters as they are (``nnx.update``
   puts the arrays in place; nothing is copied).
4. **On-policy check**: the loss's ratio is exactly 1 on every token at the step's first
   gradient (``ratio_min == ratio_max == 1``); the stock XLA path (the same weights,
   ``implementation="xla"``) samples and recomputes its own log-probs, and its drift is
   printed beside it.
5. At the end: ``save_pretrained``, a reload, and the reloaded model's log-probs of the last
   batch compared bitwise with the trained model's.

Each step prints a progress line; ``--out`` gets ``history.csv``, ``grpo.png`` (reward, KL,
our ratio and the stock drift) and the checkpoint.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl_kernels import models, nn, rl, text
from jaxrl_kernels.cli.grpo_demo import stock_twin

SYSTEM = "Answer with the number only."


def make_tiny_folder(path: str, *, seed: int = 0, preset: str | None = None,
                     dtype: str = "float32") -> str:
  """A random model and a word-level tokenizer (digits, the task's words and ChatML tokens)
  in ``path``: the example runs without a download. The model is tiny (Qwen2-style), or a
  ``models.preset`` at its full shape (the tokenizer then has one word per id of its
  vocabulary)."""
  from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415 - the [text] extra
  from tokenizers import decoders, pre_tokenizers
  from tokenizers.models import WordLevel

  words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]", "system", "user",
           "assistant", "What", "is", "+", "?", "=", "Answer", "with", "the", "number",
           "only", ".", "\n"] + [str(i) for i in range(100)]
  if preset is not None:  # one word per id of the preset's vocabulary: every id decodes
    vocab = models.config(preset).vocab_size
    words += [f"<extra_{i}>" for i in range(vocab - len(words))]
  tok = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                               pre_tokenizers.Punctuation()])
  tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
  tok.add_special_tokens(words[:3])
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
              "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
              "{% endif %}")
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "chat_template": template}, f)
  if preset is None:
    model = models.preset("qwen2.5-0.5b", seed, dtype, num_hidden_layers=2, hidden_size=64,
                          intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, vocab_size=len(words))
  else:
    model = models.preset(preset, seed, dtype)
  models.save_pretrained(model, path)
  return path


def task(rng: np.random.Generator, n: int) -> tuple[list[str], np.ndarray]:
  a, b = rng.integers(0, 50, n), rng.integers(0, 50, n)
  return [f"What is {x} + {y} ?" for x, y in zip(a, b)], a + b


def reward(completion: str, answer: int) -> float:
  m = re.search(r"\d+", completion)
  return float(m is not None and int(m.group()) == answer)


def _prompts(tok: text.Tokenizer, questions: list[str]):
  if tok.chat_template is not None:
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q in questions]
  return questions


def _completions(tok, res, lengths, group):
  tokens, mask = np.asarray(res.tokens), np.asarray(res.completion_mask)
  out = []
  for r in range(tokens.shape[0]):
    n = int(lengths[r // group])
    ids = tokens[r, n:n + int(mask[r].sum())]
    # A checkpoint's vocabulary may be padded past the tokenizer's (Qwen: 151936 rows for
    # 151665 ids): such ids have no text.
    out.append(tok.decode(ids[ids < tok.vocab_size]))
  return out


def _progress(step: int, steps: int, row: dict) -> str:
  done = int(20 * (step + 1) / steps)
  return (f"[{'#' * done}{'.' * (20 - done)}] step {step + 1}/{steps}  reward "
          f"{row['reward']:.3f}  kl {row['kl']:.2e}  ratio==1 "
          f"{'yes' if row['ratio_exact'] else 'NO'}  stock max|dlogp| {row['stock_drift']:.2e}"
          f"  {row['seconds']:.1f}s")


def run(args) -> list[dict]:
  model = models.from_pretrained(args.model)
  tok = text.Tokenizer.from_pretrained(args.model)
  if tok.vocab_size > model.config.vocab_size:
    raise SystemExit(f"grpo_hf: the tokenizer has {tok.vocab_size} ids but the model "
                     f"{model.config.vocab_size}")
  stock = stock_twin(model)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ref_params = jax.tree.map(jnp.copy, params)  # the reference policy: the initial weights
  tx = optax.adamw(args.lr, weight_decay=0.0)
  opt_state = tx.init(params)
  g = args.group

  @jax.jit
  def logp_of(p, tokens, mask):
    return nnx.merge(graphdef, p, rest).logp(tokens[:, :-1], tokens[:, 1:], mask)

  stock_graph = nnx.split(stock)[0]

  @jax.jit
  def stock_logp(state, tokens, mask):
    return nnx.merge(stock_graph, state).logp(tokens[:, :-1], tokens[:, 1:], mask)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(p, opt, tokens, mask, old_logp, ref_logp, adv):
    def loss_fn(p):
      m = nnx.merge(graphdef, p, rest)
      return m.policy_loss(tokens[:, :-1], tokens[:, 1:], mask, old_logp=old_logp,
                           advantages=adv, ref_logp=ref_logp, beta=args.beta)
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
    updates, opt = tx.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt, loss, metrics

  rng = np.random.default_rng(args.seed)
  key = jax.random.key(args.seed)
  history = []
  for step in range(args.steps):
    t0 = time.perf_counter()
    questions, answers = task(rng, args.prompts)
    ids, lengths = tok.batch(_prompts(tok, questions))
    key, k = jax.random.split(key)
    res = nn.sample(model, ids, lengths, num_samples=g, max_new_tokens=args.new_tokens, key=k,
                    temperature=args.temperature, stop_ids=tuple(tok.eos_ids))
    texts = _completions(tok, res, np.asarray(lengths), g)
    rewards = np.array([reward(c, int(answers[r // g])) for r, c in enumerate(texts)],
                       np.float32)
    mask = res.completion_mask[:, 1:]
    old = res.logp[:, 1:]
    ref = logp_of(ref_params, res.tokens, mask)
    adv = rl.group_advantages(jnp.asarray(rewards), g, mask=jnp.any(mask, axis=-1))
    params, opt_state, loss, metrics = train_step(params, opt_state, res.tokens, mask, old,
                                                  ref, adv)
    nnx.update(model, params)  # the sampler reads the new arrays in place
    # The stock path on the same weights: its own sampler against its own trainer.
    nnx.update(stock, nnx.state(model))
    sres = nn.sample(stock, ids, lengths, num_samples=g, max_new_tokens=args.new_tokens, key=k,
                     temperature=args.temperature, stop_ids=tuple(tok.eos_ids))
    smask = sres.completion_mask[:, 1:]
    strain = stock_logp(nnx.state(stock), sres.tokens, smask)
    drift = float(jnp.max(jnp.where(smask, jnp.abs(strain - sres.logp[:, 1:]), 0.0)))
    row = {"step": step, "reward": float(rewards.mean()), "loss": float(loss),
           "kl": float(metrics["kl"]),
           "ratio_exact": float(metrics["ratio_min"]) == 1.0 == float(metrics["ratio_max"]),
           "stock_drift": drift, "seconds": time.perf_counter() - t0}
    history.append(row)
    print(_progress(step, args.steps, row), flush=True)
  last = (res.tokens, mask)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "history.csv"), "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=list(history[0]))
      w.writeheader()
      w.writerows(history)
    _plot(history, os.path.join(args.out, "grpo.png"))
    ckpt = os.path.join(args.out, "checkpoint")
    models.save_pretrained(model, ckpt)
    reloaded = models.from_pretrained(ckpt)
    a = np.asarray(logp_of(nnx.state(model, nnx.Param), *last))
    b = np.asarray(reloaded.logp(last[0][:, :-1], last[0][:, 1:], last[1]))
    same = np.array_equal(a.view(np.uint32), b.view(np.uint32))
    print(f"saved {ckpt}; reloaded log-probs bitwise equal: {'yes' if same else 'NO'}")
    history[-1]["reload_bitwise"] = same
  return history


def _plot(history: list[dict], path: str) -> None:
  try:
    import matplotlib  # noqa: PLC0415 - optional
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    print("grpo_hf: matplotlib is not installed: history.csv only (pip install matplotlib)")
    return
  steps = [r["step"] for r in history]
  fig, ax = plt.subplots(1, 3, figsize=(12, 3.2))
  ax[0].plot(steps, [r["reward"] for r in history])
  ax[0].set_title("mean reward")
  ax[1].plot(steps, [r["kl"] for r in history])
  ax[1].set_title("KL to the initial policy (k3)")
  ax[2].plot(steps, [0.0 if r["ratio_exact"] else 1.0 for r in history],
             label="jaxrl_kernels: ratio != 1")
  ax[2].plot(steps, [r["stock_drift"] for r in history], label="stock XLA max |dlogp|")
  ax[2].set_title("sampler vs trainer")
  ax[2].legend()
  for a in ax:
    a.set_xlabel("step")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", help="a local Hugging Face folder (config.json, *.safetensors, "
                                 "tokenizer.json)")
  p.add_argument("--tiny-folder", help="write a tiny random model + tokenizer here and use it")
  p.add_argument("--preset", help="with --tiny-folder: a models.preset name (e.g. "
                                  "qwen2.5-0.5b) at its full shape instead of the tiny model")
  p.add_argument("--dtype", default="float32", help="with --tiny-folder: the weights' dtype")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--new-tokens", type=int, default=8)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--lr", type=float, default=1e-5)
  p.add_argument("--beta", type=float, default=0.04)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  if args.tiny_folder:
    args.model = make_tiny_folder(args.tiny_folder, seed=args.seed, preset=args.preset,
                                  dtype=args.dtype)
  elif args.preset:
    p.error("--preset needs --tiny-folder (the folder to write the random model to)")
  if not args.model:
    p.error("--model or --tiny-folder is required")
  history = run(args)
  ok = all(r["ratio_exact"] for r in history) and history[-1].get("reload_bitwise", True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
