"""``jaxrl-kernels grpo-demo``: a short GRPO run on a verifiable toy task.

The task: the prompt is ``a + b =`` (two digits), the answer is the digits of
``a + b`` followed by ``<eos>``. Reward: 1 for the exact answer; otherwise the
fraction of answer positions already right (shaping, so a tiny model learns
within a few dozen steps).

Every step:

1. **Rollout**: the KV-cache sampler (:func:`jaxrl_kernels.nn.sample`) draws
   ``group_size`` completions for each of ``prompts_per_step`` prompts and
   reports each sampled token's log-prob (the "old" log-probs).
2. **On-policy check, before the update**: the trainer's full-sequence forward
   recomputes those log-probs on the step's first micro-batch, at the
   micro-batch's batch size (not the sampler's). We log max |Δlogp|, the k3
   KL, and whether every ratio ``exp(logp - old_logp)`` is exactly 1.
   The same comparison is also made inside the loss that ``jax.grad``
   differentiates (columns ``*_jaxrl_grad``).
3. **Update**: :class:`jaxrl_kernels.train.Trainer` with ``docs_per_step``
   (one document = one completion) and the GRPO objective (group advantages, the
   clipped surrogate) fused into the LM head (``policy_loss``, see
   :func:`jaxrl_kernels.rl.linear_policy_loss`) over micro-batches of whole groups, then
   one optax Adam step.

Step 2 runs for both paths with the *same parameters*: jaxrl_kernels
(``implementation=None``) and the stock XLA path (``implementation="xla"``:
``jnp.dot``, materialised log-softmax, einsum attention), each sampling with
its own decode path and recomputing with its own training forward. Only the
jaxrl_kernels model is trained.

The policy (``--model``): a :class:`~jaxrl_kernels.nn.TinyCausalLM` preset
(``test``, ``tiny``, ``small``; the task's 16-token vocabulary), a
``jaxrl_kernels.models`` preset (a :class:`~jaxrl_kernels.models.DecoderLM` with
random weights at a public shape, e.g. ``qwen2.5-0.5b``; ``--layers`` makes it
shallower) or ``hf:PATH`` (a local Hugging Face folder). The task's tokens are ids
0..15 of the model's vocabulary; a larger model may sample any id, and the reward
counts only the task's answer. The stock twin is the same model object graph with
``implementation="xla"`` holding the same parameter arrays.

Outputs: ``grpo_demo.csv`` and
``grpo_demo.png`` (reward, and mismatch on a log scale with exact zeros drawn
on the floor) in ``--out``; the plot needs matplotlib (``pip install
'jaxrl_kernels[demo]'``), without it only the CSV is written.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

from jaxrl_kernels import _backend, models, rl
from jaxrl_kernels.models import DecoderConfig, DecoderLM
from jaxrl_kernels.nn.sampler import sample
from jaxrl_kernels.nn.tiny_lm import TinyCausalLM, TinyLMConfig
from jaxrl_kernels.train import Trainer

PLUS, EQ, EOS = 10, 11, 12
VOCAB = 16
PROMPT_LEN = 4
NEW_TOKENS = 3  # at most two digits and <eos>: the shortest completion that can be exact
TINY_PRESETS = ("test", "tiny", "small")
MODEL_CHOICES = (*TINY_PRESETS, *sorted(models.PRESETS), "hf:PATH")
MODEL_DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "auto")
FIELDS = ("step", "reward", "exact", "max_dlogp_jaxrl", "kl_jaxrl", "ratio_exact_jaxrl",
          "max_dlogp_xla", "kl_xla", "ratio_exact_xla", "max_dlogp_jaxrl_grad",
          "ratio_exact_jaxrl_grad", "loss", "seconds")


DESCRIPTION = ("A short GRPO run on a toy task (a + b =): jaxrl_kernels' trainer log-probs vs "
               "its sampler's, against the stock XLA path, at every step.")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
  from jaxrl_kernels.cli import parity as cli

  p.add_argument("--steps", type=cli.positive_int, default=80, help="optimizer steps")
  p.add_argument("--prompts-per-step", type=cli.positive_int, default=8,
                 help="prompts (groups) per step")
  p.add_argument("--group-size", type=cli.positive_int, default=4,
                 help="completions per prompt")
  p.add_argument("--docs-per-step", type=cli.non_negative_int, default=0,
                 help="completions per optimizer step (0: all of the step's)")
  p.add_argument("--micro-batch-groups", type=cli.positive_int, default=2,
                 help="groups per micro-batch (the trainer's batch size, in groups)")
  p.add_argument("--lr", type=cli.positive_float, default=3e-3, help="Adam learning rate")
  p.add_argument("--new-tokens", type=cli.int_at_least(NEW_TOKENS, " (two digits and <eos>)"),
                 default=NEW_TOKENS,
                 help=f"completion tokens sampled per prompt (>= {NEW_TOKENS})")
  p.add_argument("--temperature", type=cli.temperature, default=1.0,
                 help="sampling temperature")
  p.add_argument("--model", default="tiny", metavar="MODEL",
                 help="the policy: a TinyCausalLM preset (test, tiny, small; the task's "
                      "16-token vocabulary), a jaxrl_kernels.models preset (DecoderLM, random "
                      f"weights at the public shape: {', '.join(sorted(models.PRESETS))}) or "
                      "hf:PATH (a local Hugging Face folder)")
  p.add_argument("--model-dtype", default=None, choices=MODEL_DTYPES,
                 help="parameter, activation and KV-cache dtype (None: float32 for the "
                      "TinyCausalLM presets, bfloat16 for the models presets, the "
                      "checkpoint's for hf:PATH; auto: the checkpoint's torch_dtype)")
  p.add_argument("--layers", type=cli.positive_int, default=None,
                 help="num_hidden_layers of a models preset (a shallower copy for quick runs)")
  p.add_argument("--implementation", default=None, choices=_backend.IMPLEMENTATIONS,
                 help="jaxrl_kernels' implementation (None: the device's default)")
  p.add_argument("--seed", type=cli.seed, default=0,
                 help="seed of the model, the data, sampling")
  p.add_argument("--out", default="grpo_demo_out", help="folder for the CSV and the PNG")
  p.add_argument("--no-plot", action="store_true", help="write the CSV only")
  return p


def make_prompts(rng: np.random.Generator, n: int, new_tokens: int = NEW_TOKENS):
  """``n`` prompts ``[a, +, b, =]`` and their answers ``[n, new_tokens]`` (digits of
  a + b, then <eos>, then -1)."""
  a = rng.integers(0, 10, n)
  b = rng.integers(0, 10, n)
  prompts = np.stack([a, np.full(n, PLUS), b, np.full(n, EQ)], axis=1).astype(np.int32)
  answers = np.full((n, new_tokens), -1, np.int32)
  for i, s in enumerate(a + b):
    digits = [int(c) for c in str(int(s))] + [EOS]
    answers[i, :len(digits)] = digits
  return prompts, answers


def rewards_of(completions: np.ndarray, answers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(reward, exact)`` per row: exact match of the answer (up to <eos>) gives 1;
  otherwise the fraction of answer positions that are right."""
  valid = answers >= 0
  hits = (completions == answers) & valid
  exact = hits.sum(1) == valid.sum(1)
  return np.where(exact, 1.0, hits.sum(1) / valid.sum(1) * 0.5).astype(np.float32), exact


@dataclasses.dataclass(frozen=True)
class PolicySpec:
  """The policy that ``--model``, ``--model-dtype`` and ``--layers`` name, checked before
  anything is built or loaded.

  Attributes:
    kind: ``"tiny"`` (a :class:`TinyLMConfig` preset), ``"preset"`` (a name of
      ``models.PRESETS``) or ``"hf"`` (a Hugging Face folder).
    name: the ``--model`` argument.
    config: the model's :class:`TinyLMConfig` (vocabulary: the task's 16 ids) or
      :class:`~jaxrl_kernels.models.DecoderConfig` (``--layers`` applied).
    dtype: ``"float32"`` or ``"bfloat16"``; None for a folder loaded in the checkpoint's dtype.
  """

  kind: str
  name: str
  config: TinyLMConfig | DecoderConfig
  dtype: str | None

  @property
  def path(self) -> str:
    """The folder of an ``hf:PATH`` policy."""
    return self.name[len("hf:"):]


def policy_spec(model: str, *, dtype: str | None = None, layers: int | None = None
                ) -> PolicySpec:
  """Checks ``--model`` / ``--model-dtype`` / ``--layers`` and reads the architecture (an
  ``hf:`` folder's ``config.json`` only: no weights).

  Raises:
    ValueError: naming the flag: an unknown ``--model``, a folder without
      ``config.json``, ``--layers`` with a policy that is not a ``models`` preset or
      below 1, an unknown ``--model-dtype``, a vocabulary smaller than the task's 16 ids.
  """
  if dtype is not None and dtype not in MODEL_DTYPES:
    raise ValueError(f"grpo-demo: --model-dtype must be one of {', '.join(MODEL_DTYPES)}, got "
                     f"{dtype!r}")
  if layers is not None:
    if model not in models.PRESETS:
      raise ValueError(f"grpo-demo: --layers applies to the models presets "
                       f"({', '.join(sorted(models.PRESETS))}) only, got --model {model!r}")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
      raise ValueError(f"grpo-demo: --layers must be an int >= 1, got {layers!r}")
  if model in TINY_PRESETS:
    tiny_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "auto": "float32"}.get(dtype, dtype or "float32")
    try:
      cfg = TinyLMConfig.preset(model, vocab_size=VOCAB, dtype=tiny_dtype)
    except ValueError as e:
      raise ValueError(f"grpo-demo: --model-dtype {dtype} with --model {model}: {e}") from None
    spec = PolicySpec("tiny", model, cfg, cfg.dtype)
  elif model in models.PRESETS:
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    spec = PolicySpec("preset", model, models.config(model, **overrides), dtype or "bfloat16")
  elif model.startswith("hf:"):
    cfg_path = os.path.join(model[len("hf:"):], "config.json")
    if not os.path.isfile(cfg_path):
      raise ValueError(f"grpo-demo: --model {model}: expected a Hugging Face folder with "
                       f"config.json, but {cfg_path} does not exist")
    try:
      with open(cfg_path) as f:
        cfg = models.from_hf_dict(json.load(f))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
      raise ValueError(f"grpo-demo: --model {model}: cannot read {cfg_path}: {e}") from None
    spec = PolicySpec("hf", model, cfg, dtype)
  else:
    raise ValueError(f"grpo-demo: --model must be one of {', '.join(MODEL_CHOICES)}, got "
                     f"{model!r}")
  if spec.config.vocab_size < VOCAB:
    raise ValueError(f"grpo-demo: --model {model} has a vocabulary of {spec.config.vocab_size} "
                     f"ids, but the task's tokens are ids 0..{VOCAB - 1} (at least {VOCAB})")
  return spec


def _count(n: int, noun: str) -> str:
  return f"{n} {noun}" + ("" if n == 1 else "s")


def _size(n: int) -> str:
  for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= scale:
      return f"{n / scale:.1f}{unit}"
  return str(n)


def describe(spec: PolicySpec) -> str:
  """One line on the policy (under 100 columns but for an ``hf:`` folder's path)."""
  cfg = spec.config
  if spec.kind == "tiny":
    return (f"{spec.name}: TinyCausalLM, {_count(cfg.num_layers, 'layer')}, hidden "
            f"{cfg.hidden}, {cfg.vocab_size} ids, {spec.dtype}")
  weights = "random weights" if spec.kind == "preset" else "weights from the folder"
  return (f"{spec.name}: DecoderLM {cfg.model_type}, {_count(cfg.num_hidden_layers, 'layer')}, "
          f"{_size(cfg.num_params())} parameters, {spec.dtype or 'checkpoint dtype'}, "
          f"{weights}")


def build_policy(spec: PolicySpec, *, seed: int, implementation: str | None
                 ) -> TinyCausalLM | DecoderLM:
  """The policy on the batch-invariant kernels (``implementation``; None: the device's
  default). Random weights (tiny and models presets) come from ``seed``."""
  if spec.kind == "tiny":
    cfg = dataclasses.replace(spec.config, implementation=implementation)
    return TinyCausalLM(cfg, rngs=nnx.Rngs(seed))
  if spec.kind == "preset":
    return models.preset(spec.name, seed, spec.dtype, implementation=implementation,
                         num_hidden_layers=spec.config.num_hidden_layers)
  return models.from_pretrained(spec.path, dtype=spec.dtype, param_dtype=spec.dtype,
                                implementation=implementation)


def stock_twin(model: TinyCausalLM | DecoderLM) -> TinyCausalLM | DecoderLM:
  """The stock XLA path of ``model``: the same module with ``implementation="xla"``, holding
  the same parameter arrays (no copy; ``nnx.update`` keeps it in step after an update)."""
  if isinstance(model, TinyCausalLM):
    cfg = dataclasses.replace(model.config, implementation="xla")

    def make():
      return TinyCausalLM(cfg, rngs=nnx.Rngs(0))
  elif isinstance(model, DecoderLM):
    param_dtype = model.embed_tokens.embedding.get_value().dtype

    def make():
      return DecoderLM(model.config, dtype=model.dtype, param_dtype=param_dtype,
                       implementation="xla", remat=model.remat, row_chunks=model.row_chunks,
                       rngs=nnx.Rngs(0))
  else:
    raise TypeError(f"grpo-demo: model must be a TinyCausalLM or a DecoderLM, got "
                    f"{type(model).__name__}")
  # Only the graph of the abstract twin is used: no second set of weights is ever drawn.
  graphdef, _ = nnx.split(nnx.eval_shape(make))
  return nnx.merge(graphdef, nnx.state(model))


def _jitted_logp(model: TinyCausalLM | DecoderLM, temperature: float):
  graphdef, state = nnx.split(model)

  @jax.jit
  def f(state, tokens, mask):
    m = nnx.merge(graphdef, state)
    return m.logp(tokens[:, :-1], tokens[:, 1:], mask, temperature=temperature)

  return lambda tokens, mask: f(nnx.state(model), tokens, mask)


def _mismatch(train_logp, old_logp, mask):
  """max |Δlogp|, the k3 KL estimate and whether every ratio is exactly 1, on active tokens."""
  train_logp, old_logp, mask = (np.asarray(x) for x in (train_logp, old_logp, mask))
  d = np.where(mask, train_logp.astype(np.float64) - old_logp, 0.0)
  kl = float(rl.kl(jnp.asarray(train_logp), jnp.asarray(old_logp), mask=jnp.asarray(mask)).sum()
             / max(int(mask.sum()), 1))
  same = bool(np.array_equal(np.where(mask, train_logp, 0).view(np.uint32),
                             np.where(mask, old_logp, 0).view(np.uint32)))
  return float(np.max(np.abs(d))), kl, same


def _rollout(model, prompts, key, temperature, new_tokens):
  res = sample(model, jnp.asarray(prompts), jnp.full((len(prompts),), PROMPT_LEN, jnp.int32),
               max_new_tokens=new_tokens, key=key, temperature=temperature, eos_id=EOS)
  tokens = np.asarray(res.tokens)
  # Training layout: position j predicts token j + 1.
  mask = np.asarray(res.completion_mask)[:, 1:]
  old = np.asarray(res.logp)[:, 1:]
  return tokens, mask, old


def _compiling(step: int, what: str) -> None:
  """Says what step 0 is about to compile (a real-shape model takes minutes)."""
  if step == 0:
    print(f"  {what} ...", flush=True)


def check_arguments(args: argparse.Namespace) -> PolicySpec:
  """Checks what the parser cannot (how the flags combine, an ``hf:`` folder's
  ``config.json``) and returns the policy's :class:`PolicySpec`.

  Raises:
    ValueError: naming the flag (:func:`policy_spec`'s, sizes below their minimum,
      micro-batches that do not split a step's completions).
  """
  for name, minimum in (("steps", 1), ("prompts_per_step", 1), ("group_size", 1),
                        ("micro_batch_groups", 1), ("docs_per_step", 0),
                        ("new_tokens", NEW_TOKENS)):
    v = getattr(args, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
      raise ValueError(f"grpo-demo: --{name.replace('_', '-')} must be an int >= {minimum}, "
                       f"got {v!r}")
  spec = policy_spec(args.model, dtype=args.model_dtype, layers=args.layers)
  g = args.group_size
  mb_rows = args.micro_batch_groups * g
  rows = args.prompts_per_step * g
  if rows % mb_rows:
    raise ValueError(f"grpo-demo: --prompts-per-step {args.prompts_per_step} x --group-size {g} "
                     f"= {rows} completions per step do not split into micro-batches of "
                     f"--micro-batch-groups {args.micro_batch_groups} groups of {g}")
  return spec


def run(args: argparse.Namespace) -> list[dict]:
  """The GRPO run of :func:`main` (arguments of :func:`add_arguments`): one dict per step
  with the :data:`FIELDS`."""
  spec = check_arguments(args)
  g = args.group_size
  mb_rows = args.micro_batch_groups * g
  rows = args.prompts_per_step * g
  print(f"grpo-demo: {args.steps} steps of {rows} completions ({args.prompts_per_step} prompts x "
        f"{g}), micro-batches of {mb_rows} rows")
  print(f"model {describe(spec)} ...", flush=True)
  try:  # a checkpoint or a dtype the library refuses is a bad input (exit 2), not a failure
    model = build_policy(spec, seed=args.seed, implementation=args.implementation)
  except (OSError, ValueError, TypeError) as e:
    from jaxrl_kernels.cli import parity as cli
    cli.usage_error(f"grpo-demo: --model {args.model}"
                    + (f" --model-dtype {args.model_dtype}" if args.model_dtype else "")
                    + f": {e}")
  stock = stock_twin(model)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p, batch, num_documents):
    m = nnx.merge(graphdef, p, rest)
    # GRPO: group advantages, the clipped objective fused into the LM head (its gradient
    # formed in the head's forward pass), one document per completion.
    adv = rl.group_advantages(batch["rewards"], g, mask=jnp.any(batch["mask"], axis=-1))
    loss, metrics = m.policy_loss(batch["tokens"][:, :-1], batch["tokens"][:, 1:],
                                  batch["mask"], temperature=args.temperature,
                                  old_logp=batch["old_logp"], advantages=adv,
                                  token_level=False, denominator=num_documents)
    # The log-probs the gradient is taken of, against the sampler's, on the first
    # micro-batch only (the Trainer sums aux over micro-batches; the others add 0).
    lp, old, mask = metrics["logp"], batch["old_logp"], batch["mask"]
    differ = mask & (lax.bitcast_convert_type(lp, jnp.uint32)
                     != lax.bitcast_convert_type(old, jnp.uint32))
    first = batch["first"]
    aux = {"tokens_differ": jnp.where(first, jnp.sum(differ, dtype=jnp.int32), 0),
           "max_dlogp": jnp.where(first, jnp.max(jnp.where(mask, jnp.abs(lp - old), 0.0)), 0.0)}
    return loss, aux

  trainer = Trainer(loss_fn, optax.adam(args.lr), count_documents=lambda b: len(b["rewards"]),
                    docs_per_step=args.docs_per_step or rows, has_aux=True)
  state = trainer.init(params)
  train_logp = _jitted_logp(model, args.temperature)
  stock_logp = _jitted_logp(stock, args.temperature)
  rng = np.random.default_rng(args.seed)
  key = jax.random.key(args.seed)
  history = []
  print("compiling during step 0 (the longest step):", flush=True)
  for step in range(args.steps):
    t0 = time.perf_counter()
    nnx.update(model, nnx.merge_state(state.params, rest))
    nnx.update(stock, nnx.state(model))  # the stock path sees the same parameters
    prompts, answers = make_prompts(rng, args.prompts_per_step, args.new_tokens)
    prompts, answers = np.repeat(prompts, g, 0), np.repeat(answers, g, 0)
    key, k = jax.random.split(key)
    row = {"step": step}
    for name, m, recompute in (("jaxrl", model, train_logp), ("xla", stock, stock_logp)):
      label = "jaxrl_kernels" if name == "jaxrl" else "stock XLA"
      _compiling(step, f"{label}: sampler, trainer forward")
      tokens, mask, old = _rollout(m, prompts, k, args.temperature, args.new_tokens)
      # The trainer's first micro-batch, at its own batch size.
      mx = _mismatch(recompute(tokens[:mb_rows], mask[:mb_rows]), old[:mb_rows], mask[:mb_rows])
      row[f"max_dlogp_{name}"], row[f"kl_{name}"], row[f"ratio_exact_{name}"] = mx
      if name == "jaxrl":
        batch_tokens, batch_mask, batch_old = tokens, mask, old
    reward, exact = rewards_of(batch_tokens[:, PROMPT_LEN:], answers)
    micro = ({"tokens": jnp.asarray(batch_tokens[i:i + mb_rows]),
              "mask": jnp.asarray(batch_mask[i:i + mb_rows]),
              "old_logp": jnp.asarray(batch_old[i:i + mb_rows]),
              "rewards": jnp.asarray(reward[i:i + mb_rows]), "first": jnp.asarray(i == 0)}
             for i in range(0, rows, mb_rows))
    _compiling(step, "training step (jax.grad, Adam)")
    state, metrics = trainer.step(state, micro)
    row.update(max_dlogp_jaxrl_grad=float(metrics["aux"]["max_dlogp"]),
               ratio_exact_jaxrl_grad=int(metrics["aux"]["tokens_differ"]) == 0)
    row.update(reward=float(reward.mean()), exact=float(exact.mean()),
               loss=float(metrics["loss"]), seconds=time.perf_counter() - t0)
    history.append(row)
    if step == 0:
      print(HEADER)
    print(step_line(row), flush=True)
  return history


def _num(x: float) -> str:
  return "0" if x == 0 else f"{x:.1e}"


# The progress table: max |logp_train - logp_sampler| on the step's first micro-batch, for
# jaxrl_kernels forward-only and inside jax.grad (ratio==1: both bitwise) and stock XLA.
HEADER = (f"{'step':>4}  {'reward':>6}  {'exact':>5}  {'max|dlogp| jaxrl':>16}  {'in grad':>8}  "
          f"{'ratio==1':>8}  {'stock XLA':>9}  {'time':>7}")


def step_line(row: dict) -> str:
  """One step's row of the progress table (:data:`HEADER`, under 100 columns)."""
  ours = "yes" if row["ratio_exact_jaxrl"] and row["ratio_exact_jaxrl_grad"] else "NO"
  return (f"{row['step']:4d}  {row['reward']:6.3f}  {row['exact']:5.2f}  "
          f"{_num(row['max_dlogp_jaxrl']):>16}  {_num(row['max_dlogp_jaxrl_grad']):>8}  "
          f"{ours:>8}  {_num(row['max_dlogp_xla']):>9}  {row['seconds']:6.1f}s")


def has_matplotlib() -> bool:
  """Whether matplotlib imports (checked before training, not after it)."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return False
  return True


def write_csv(history: list[dict], path: str) -> None:
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=FIELDS)
    w.writeheader()
    for row in history:
      w.writerow({k: row[k] for k in FIELDS})


def plot(history: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [r["step"] for r in history]
  fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
  ax1.plot(steps, [r["reward"] for r in history], label="mean reward")
  ax1.plot(steps, [r["exact"] for r in history], label="exact answers")
  ax1.set_ylabel("reward")
  ax1.legend()
  floor = 1e-10
  for name, label, style in (("xla", "stock XLA", dict(marker="o")),
                             ("jaxrl", "jaxrl_kernels", dict(marker="o")),
                             ("jaxrl_grad", "jaxrl_kernels, inside jax.grad",
                              dict(marker="x", ls=":"))):
    vals = [r[f"max_dlogp_{name}"] for r in history]
    ax2.plot(steps, [max(v, floor) for v in vals], label=label, **style)
  ax2.axhline(floor, color="gray", lw=0.5)
  ax2.set_yscale("log")
  ax2.set_ylim(floor / 3, 1)
  ax2.set_ylabel("max |logp_train - logp_sampler|\n(first micro-batch; 0 drawn at 1e-10)")
  ax2.set_xlabel("step")
  ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv: list[str] | argparse.Namespace | None = None) -> int:
  """The command: exit status 0 when the on-policy ratio was exactly 1 at every step, 1
  when it was not, 2 (one line on stderr naming the flag, nothing run) for arguments or
  input files that cannot run."""
  from jaxrl_kernels.cli import parity as cli

  if isinstance(argv, argparse.Namespace):
    args = argv
  else:
    parser = cli.Parser(prog="jaxrl-kernels grpo-demo", description=DESCRIPTION,
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    args = add_arguments(parser).parse_args(argv)
  try:
    check_arguments(args)
  except ValueError as e:
    cli.usage_error(str(e))
  try:
    os.makedirs(args.out, exist_ok=True)
  except OSError as e:
    cli.usage_error(f"grpo-demo: --out {args.out}: {e}")
  if not args.no_plot and not has_matplotlib():
    print("grpo-demo: matplotlib is not installed: writing the CSV only (for the plot: "
          "pip install 'jaxrl_kernels[demo]')", flush=True)
    args = argparse.Namespace(**{**vars(args), "no_plot": True})
  history = run(args)
  write_csv(history, os.path.join(args.out, "grpo_demo.csv"))
  if not args.no_plot:
    plot(history, os.path.join(args.out, "grpo_demo.png"))
  ok = all(r["ratio_exact_jaxrl"] for r in history)
  stock = sum(not r["ratio_exact_xla"] for r in history)
  print(f"wrote {args.out}/grpo_demo.csv" + ("" if args.no_plot else " and grpo_demo.png"))
  print(f"stock XLA: the ratio differed from 1 at {stock} of {len(history)} steps")
  print("jaxrl_kernels: the on-policy ratio was exactly 1 at every step's first micro-batch"
        if ok else "jaxrl_kernels: the on-policy ratio was NOT exactly 1 at some step")
  return 0 if ok else 1
