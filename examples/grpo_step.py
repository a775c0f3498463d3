"""A complete GRPO step on ``TinyCausalLM`` with optax, runnable on a CPU.

    python examples/grpo_step.py [--steps 5] [--preset tiny]

Each step: (1) a jitted sampler rolls out ``samples`` completions per prompt,
reading the logits with ``model.head.logits`` and storing the sampled tokens'
log-probs from the fused head ``model.head(h, token)`` (the rollout "old"
log-probs; ``jaxrl_kernels.nn.sample`` is the KV-cache sampler that does the same);
(2) a toy verifiable reward (the fraction of completion tokens equal to
``--target-token``); (3) one jitted optimizer step on GRPO (``rl.group_advantages``
and the PPO clip fused into the LM head, ``model.policy_loss``:
``rl.linear_policy_loss``), whose training forward recomputes the log-probs with the
head's kernels. Every op is batch-invariant and gives the same bits
forward-only and inside ``jax.grad``, so the trainer's log-probs equal the
sampler's bit for bit: each step prints ``max|dlogp|`` (exactly 0) and how many
of the completion tokens' log-probs differ in any bit (0), so every ratio is
exactly 1 before the update. Step 0 compiles (most of the run's time on a CPU;
later steps take well under a second). No XLA flag is needed: on a CPU the default
implementation (``"cpu"``) is immune to FMA contraction by construction;
``--implementation`` picks another one (``"xla"``: the stock path, for comparison).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl_kernels import rl
from jaxrl_kernels.nn.tiny_lm import TinyCausalLM, TinyLMConfig


def make_sampler(graphdef, prompt_len: int, completion_len: int):
  """Returns ``sample(state, prompts [B, P], key) -> (tokens [B, P+C], logp [B, P+C-1])``."""

  @jax.jit
  def sample(state, prompts, key):
    model = nnx.merge(graphdef, state)
    b = prompts.shape[0]
    t = prompt_len + completion_len
    tokens = jnp.zeros((b, t), jnp.int32).at[:, :prompt_len].set(prompts)
    logp = jnp.zeros((b, t - 1), jnp.float32)

    def step(p, carry):
      tokens, logp, key = carry
      key, sub = jax.random.split(key)
      # Full forward over the fixed-size buffer: the not-yet-written positions
      # are in the future of position p - 1, so causality hides them.
      h = model(tokens)
      h_last = jax.lax.dynamic_index_in_dim(h, p - 1, axis=1, keepdims=False)  # [B, H]
      logits = model.head.logits(h_last)
      tok = jax.random.categorical(sub, logits).astype(jnp.int32)
      lp = model.head(h_last, tok)  # the fused head: the trainer's own kernels
      tokens = jax.lax.dynamic_update_index_in_dim(tokens, tok, p, axis=1)
      logp = jax.lax.dynamic_update_index_in_dim(logp, lp, p - 1, axis=1)
      return tokens, logp, key

    tokens, logp, _ = jax.lax.fori_loop(prompt_len, t, step, (tokens, logp, key))
    return tokens, logp

  return sample


def make_train_step(graphdef, rest, tx, samples: int, clip: float):
  """Returns a jitted ``train_step(params, opt_state, tokens, old_logp, rewards, mask)``."""

  def loss_fn(params, tokens, old_logp, rewards, mask):
    model = nnx.merge(graphdef, params, rest)
    # GRPO: group advantages, then the clipped objective fused into the LM head (the loss's
    # gradient is formed where the logits live; the [B, T, V] logits never exist).
    adv = rl.group_advantages(rewards, samples, mask=jnp.any(mask, axis=-1))
    loss, metrics = model.policy_loss(tokens[:, :-1], tokens[:, 1:], mask, old_logp=old_logp,
                                      advantages=adv, clip_low=clip, clip_high=clip)
    # The log-probs the gradient is taken of (bitwise model.logp's), against the sampler's,
    # on the raw bits.
    lp = metrics.pop("logp")
    metrics.pop("entropy")
    drift = jnp.max(jnp.where(mask, jnp.abs(lp - old_logp), 0.0))
    differ = mask & (jax.lax.bitcast_convert_type(lp, jnp.uint32)
                     != jax.lax.bitcast_convert_type(old_logp, jnp.uint32))
    return loss, {**metrics, "max_abs_dlogp": drift,
                  "tokens_differ": jnp.sum(differ, dtype=jnp.int32),
                  "tokens": jnp.sum(mask, dtype=jnp.int32)}

  @jax.jit
  def train_step(params, opt_state, tokens, old_logp, rewards, mask):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, tokens, old_logp, rewards, mask)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics["loss"] = loss
    metrics["grad_norm"] = optax.global_norm(grads)
    return params, opt_state, metrics

  return train_step


def main(argv: list[str] | None = None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="tiny", help="TinyLMConfig preset: test, tiny, small")
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--samples", type=int, default=4, help="completions per prompt (group size)")
  ap.add_argument("--prompt-len", type=int, default=4)
  ap.add_argument("--completion-len", type=int, default=8)
  ap.add_argument("--target-token", type=int, default=7)
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--clip", type=float, default=0.2)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--implementation", default=None,
                  help="jaxrl_kernels implementation (default: the device's)")
  args = ap.parse_args(argv)

  cfg = TinyLMConfig.preset(args.preset, implementation=args.implementation)
  model = TinyCausalLM(cfg, rngs=nnx.Rngs(args.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adam(args.lr)
  opt_state = tx.init(params)
  sample = make_sampler(graphdef, args.prompt_len, args.completion_len)
  train_step = make_train_step(graphdef, rest, tx, args.samples, args.clip)

  key = jax.random.key(args.seed)
  b = args.prompts * args.samples
  t = args.prompt_len + args.completion_len
  # Targets at index j predict token j + 1: the completion is j >= prompt_len - 1.
  mask = jnp.broadcast_to(jnp.arange(t - 1) >= args.prompt_len - 1, (b, t - 1))
  history = []
  for step in range(args.steps):
    t0 = time.perf_counter()
    key, k_prompt, k_sample = jax.random.split(key, 3)
    prompts = jax.random.randint(k_prompt, (args.prompts, args.prompt_len), 0, cfg.vocab_size)
    prompts = jnp.repeat(prompts, args.samples, axis=0)  # rows [g k, (g+1) k) share a prompt
    tokens, old_logp = sample(nnx.merge_state(params, rest), prompts, k_sample)
    completion = tokens[:, args.prompt_len:]
    rewards = jnp.mean((completion == args.target_token).astype(jnp.float32), axis=1)
    params, opt_state, metrics = train_step(params, opt_state, tokens, old_logp, rewards, mask)
    m = {k: float(v) for k, v in metrics.items()}
    m["tokens_differ"], m["tokens"] = int(metrics["tokens_differ"]), int(metrics["tokens"])
    m["reward"] = float(jnp.mean(rewards))
    m["seconds"] = time.perf_counter() - t0
    history.append(m)
    # repr of a float: 0.0 is printed as 0.0, any drift with all its digits.
    print(f"step {step}: loss {m['loss']:+.4f}  reward {m['reward']:.3f}  max|dlogp| "
          f"{m['max_abs_dlogp']!r} ({m['tokens_differ']} of {m['tokens']} log-probs differ)  "
          f"clipfrac {m['clipfrac']:.3f}  ({m['seconds']:.1f}s)")
  return history


if __name__ == "__main__":
  main()
