"""jaxrl_kernels.integrations.tunix: GRPO steps through Tunix's RLCluster and GRPOLearner on
a tiny DecoderLM, with the sampler's log-probs bitwise the trainer's at every step, and the
stock Tunix sampler and trainer beside it (which disagree)."""

import ast
import importlib.metadata
import os
import pathlib
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

pytest.importorskip("tunix", reason="Tunix is not installed (pip install jaxrl_kernels[tunix])")

from tunix.models.qwen3 import model as tunix_qwen3  # noqa: E402
from tunix.rl import common as tunix_common  # noqa: E402
from tunix.rl import rl_cluster as rlc  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout, vanilla_rollout  # noqa: E402

from jaxrl_kernels import models  # noqa: E402
from jaxrl_kernels.integrations import tunix as jt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORDS = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(29)]  # pad 0, bos 1, eos 2
PAD, EOS = 0, 2
NEW_TOKENS = 6
TEMPERATURE = 0.9


class WordTokenizer:
  """A word-level tokenizer with the methods Tunix's TokenizerAdapter asks of one."""

  def encode(self, text, **kwargs):
    return [WORDS.index(w) for w in text.split()]

  def decode(self, ids, **kwargs):
    return " ".join(WORDS[i] for i in ids)

  def bos_id(self):
    return 1

  def eos_id(self):
    return EOS

  def pad_id(self):
    return PAD


def tiny(seed=0, dtype="float32"):
  return models.preset("qwen2.5-0.5b", seed, dtype, num_hidden_layers=2, hidden_size=32,
                       intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=len(WORDS))


def one_device_mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


def rollout_config(**kw):
  kw.setdefault("temperature", TEMPERATURE)
  return base_rollout.RolloutConfig(max_tokens_to_generate=NEW_TOKENS, max_prompt_length=8,
                                    **kw)


def cluster_config(engine, steps=3, mesh=None, **kw):
  mesh = mesh or one_device_mesh()
  return rlc.ClusterConfig(
      role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
      rollout_engine=engine, rollout_config=rollout_config(return_logprobs=True),
      training_config=rlc.RLTrainingConfig(actor_optimizer=optax.adamw(1e-2),
                                           eval_every_n_steps=100, max_steps=steps), **kw)


def length_reward(prompts, completions, **kwargs):
  return [float(len(c.split())) for c in completions]


class RecordingRollout(jt.DecoderRollout):
  """DecoderRollout that keeps what it returned: the test's own copy of the sampler's
  log-probs, checked against the trainer's on raw bits."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.outputs = []

  def generate(self, prompts, rollout_config, **kwargs):
    out = super().generate(prompts, rollout_config, **kwargs)
    self.outputs.append(out)
    return out


def padded(rows, dtype, fill):
  out = np.full((len(rows), NEW_TOKENS), fill, dtype)
  for r, x in enumerate(rows):
    out[r, :len(x)] = x
  return out


def test_grpo_steps_are_bitwise_on_policy():
  """Three GRPO steps (2 prompts x 2 generations, a k1 KL to a reference of the initial
  weights): at every step the trainer's log-probs of each completion token (computed in
  the training step, under the gradient) have the raw bits the sampler reported, Tunix's
  ratio metrics are exactly 1 and 0, and the added mismatch metrics are 0."""
  cluster = jt.RLCluster(actor=tiny(), reference=tiny(), tokenizer=WordTokenizer(),
                         cluster_config=cluster_config(RecordingRollout))
  learner = jt.GRPOLearner(rl_cluster=cluster, reward_fns=length_reward,
                           algo_config=grpo_learner.GRPOConfig(num_generations=2, beta=0.04))
  trainer = cluster.actor_trainer
  # Tunix hands the loss's aux to the trainer's post-processing only: keep a copy.
  steps, post_process = [], trainer._post_process_train_step
  trainer._post_process_train_step = lambda aux: (steps.append(jax.device_get(aux)),
                                                  post_process(aux))[1]
  data = [{"prompts": np.array(["w3 w4 w5", "w6 w7"])} for _ in range(3)]  # Tunix's arrays
  learner.train(data)

  outputs = cluster.rollout.outputs
  assert len(outputs) == len(steps) == 3
  compared = 0
  for out, aux in zip(outputs, steps):
    sampled = padded([np.asarray(lp, np.float32) for lp in out.logprobs], np.float32, 0.0)
    mask = padded(out.tokens, np.int32, PAD) != PAD  # Tunix's completion mask
    trainer_logp = np.asarray(aux["per_token_logps"], np.float32)
    assert np.array_equal(trainer_logp[mask].view(np.uint32), sampled[mask].view(np.uint32))
    compared += int(mask.sum())
  assert compared >= 12  # tokens were sampled: the comparison is not empty

  log = cluster._rl_metrics_logger
  history = {name: log.get_metric_history("actor", name, "train")
             for name in ("kl", "is_ratio/min", "is_ratio/max", "log_ratio/abs_mean",
                          "logp_mismatch/max_abs", "logp_mismatch/tokens")}
  assert all(len(h) == 3 for h in history.values()), history
  assert np.all(history["logp_mismatch/tokens"] == 0)
  assert np.all(history["logp_mismatch/max_abs"] == 0)
  assert np.all(history["log_ratio/abs_mean"] == 0)
  assert np.all(history["is_ratio/min"] == 1) and np.all(history["is_ratio/max"] == 1)
  # The reference scores with the same kernels: the initial policy's KL to itself is
  # exactly 0; later steps' policies have moved (and the sampler followed them in place).
  assert history["kl"][0] == 0 and np.all(history["kl"][1:] != 0), history["kl"]



def test_stock_tunix_sampler_and_trainer_disagree():
  """The control: stock Tunix on a tiny Tunix Qwen3 (float32, CPU). Its VanillaRollout
  sampler reports log-probs from its decode loop; its GRPO loss recomputes them with
  ``tunix.rl.common.compute_per_token_logps`` (logits of the full sequence and an XLA
  log-softmax). On completions that hold no pad id the two differ in the last bits of many
  tokens (rounding: other programs, other reduction orders). On a completion where the
  sampler drew the pad id, Tunix's trainer also drops that token from the context of the
  tokens after it (its positions and attention mask come from ``ids != pad``), a
  difference far above rounding. Stock GRPO never shows either: with ``num_iterations=1``
  its old log-probs are the trainer's own under ``stop_gradient``, so its ``is_ratio`` is 1
  by construction."""
  mesh = one_device_mesh()
  cfg = tunix_qwen3.ModelConfig(num_layers=2, vocab_size=len(WORDS), embed_dim=32,
                                hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2,
                                rope_theta=10000, norm_eps=1e-6)
  with jax.set_mesh(mesh):
    model = tunix_qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
    rollout = vanilla_rollout.VanillaRollout(
        model, WordTokenizer(), base_rollout.CacheConfig(cache_size=64, num_layers=2,
                                                         num_kv_heads=2, head_dim=8))
    out = rollout.generate(["w3 w4 w5", "w6 w7"] * 4, rollout_config(return_logprobs=True))
    completions = padded(out.tokens, np.int32, PAD)
    graphdef, state = nnx.split(model)
    trainer_logp = np.asarray(tunix_common.compute_per_token_logps(
        graphdef, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
        completion_tokens=jnp.asarray(completions), pad_id=PAD, eos_id=EOS,
        temperature=TEMPERATURE))
  sampled = padded([np.asarray(lp, np.float32) for lp in out.logprobs], np.float32, 0.0)
  no_pad = np.array([not np.any(t == PAD) for t in out.tokens])
  mask = (completions != PAD) & no_pad[:, None]
  assert mask.sum() >= 12
  differ = mask & (trainer_logp.view(np.uint32) != sampled.view(np.uint32))
  assert differ.sum() > 0  # not bitwise
  assert np.max(np.abs(trainer_logp - sampled)[mask]) < 1e-4  # rounding, not a bug


def test_rollout_follows_tunix_conventions():
  """Left-padded prompts with a leading bos, completions without their eos, one float32
  log-prob per returned token; a seed in the rollout config repeats the draw;
  get_per_token_logps gives the sampler's bits; update_params puts weights in place."""
  rollout = jt.DecoderRollout(tiny(), WordTokenizer(), rollout_config=rollout_config())
  # Stop at eos or id 5 (each rollout config here: one compiled sampler for the test).
  cfg = rollout_config(return_logprobs=True, eos_tokens=[EOS, 5], seed=7)
  prompts = ["w3 w4 w5", "w6"] * 2  # the GRPO test's batch shape: its compiled sampler
  out = rollout.generate(prompts, cfg)
  np.testing.assert_array_equal(out.left_padded_prompt_tokens,
                                [[0, 0, 0, 0, 1, 6, 7, 8], [0, 0, 0, 0, 0, 0, 1, 9]] * 2)
  for tokens, logp in zip(out.tokens, out.logprobs):
    assert len(tokens) == len(logp) <= NEW_TOKENS and logp.dtype == np.float32
    assert not np.isin(tokens, [EOS, 5]).any() and np.all(logp < 0)
  assert [len(x) for x in rollout.pop_sampled_logprobs()] == [len(t) for t in out.tokens]
  assert rollout.pop_sampled_logprobs() == []
  again = rollout.generate(prompts, cfg)
  assert all(np.array_equal(a, b) for a, b in zip(out.tokens, again.tokens))
  assert rollout.generate(prompts, rollout_config(eos_tokens=[EOS, 5])).logprobs is None
  # Tunix's old-policy path (num_iterations > 1) recomputes the sampler's bits.
  completions = padded(out.tokens, np.int32, PAD)
  again = np.asarray(rollout.get_per_token_logps(jnp.asarray(out.left_padded_prompt_tokens),
                                                 jnp.asarray(completions)))
  sampled, mask = padded(out.logprobs, np.float32, 0.0), completions != PAD
  assert np.array_equal(again[mask].view(np.uint32), sampled[mask].view(np.uint32))

  other = tiny(seed=1)
  rollout.update_params(nnx.state(other, nnx.Param), (nnx.Param,))
  np.testing.assert_array_equal(rollout.model().norm.weight[...], other.norm.weight[...])
  with pytest.raises(ValueError, match="a parameter of bfloat16"):
    rollout.update_params(nnx.state(tiny(dtype="bfloat16"), nnx.Param))


def test_errors_name_the_argument():
  tok, model = WordTokenizer(), tiny()
  with pytest.raises(TypeError, match="rollout_actor must be a jaxrl_kernels DecoderLM"):
    jt.DecoderRollout(object(), tok)
  mesh8 = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("fsdp", "tp"))
  with pytest.raises(ValueError, match="mesh has 2 devices"):
    jt.DecoderRollout(model, tok, mesh8)
  rollout = jt.DecoderRollout(model, tok)
  with pytest.raises(ValueError, match="temperature must be > 0"):
    rollout.generate(["w3"], rollout_config(temperature=0.0))
  with pytest.raises(ValueError, match=r"prompts\[1\] encodes to ids holding the pad id 0"):
    rollout.generate(["w3", "w4 <pad> w5"], rollout_config())
  with pytest.raises(ValueError, match="no temperature yet"):
    rollout.get_per_token_logps(jnp.ones((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32))
  with pytest.raises(ValueError, match="rollout_engine must be DecoderRollout"):
    jt.RLCluster(actor=model, tokenizer=tok, cluster_config=cluster_config("vanilla"))
  with pytest.raises(TypeError, match="actor must be a jaxrl_kernels DecoderLM"):
    jt.RLCluster(actor=nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tokenizer=tok,
                 cluster_config=cluster_config(jt.DecoderRollout))
  with pytest.raises(ValueError, match=r"role_to_mesh\[Role.ACTOR\]: mesh has 2 devices"):
    jt.RLCluster(actor=model, tokenizer=tok,
                 cluster_config=cluster_config(jt.DecoderRollout, mesh=mesh8))
  cluster = jt.RLCluster(actor=model, tokenizer=tok,
                         cluster_config=cluster_config(jt.DecoderRollout))
  for field, value, match in [("loss_agg_mode", "seq-mean-token-sum", "loss_agg_mode must be"),
                              ("loss_algo", "gspo-token", "loss_algo must be 'grpo'"),
                              ("kl_loss_mode", "k9", "kl_loss_mode must be one of")]:
    algo = grpo_learner.GRPOConfig(num_generations=2)
    setattr(algo, field, value)
    with pytest.raises(ValueError, match=match):
      jt.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=length_reward)
  with pytest.raises(TypeError, match="rl_cluster must be jaxrl_kernels.integrations.tunix"):
    jt.GRPOLearner(rl_cluster=object(), reward_fns=length_reward,
                   algo_config=grpo_learner.GRPOConfig(num_generations=2))
  example = grpo_learner.TrainExample(
      prompt_ids=jnp.ones((1, 2), jnp.int32), prompt_mask=jnp.ones((1, 2), bool),
      completion_ids=jnp.ones((1, 2), jnp.int32), completion_mask=jnp.ones((1, 2), bool),
      advantages=jnp.zeros((1,)), ref_per_token_logps=None, old_per_token_logps=None)
  with pytest.raises(ValueError, match="old_per_token_logps is None"):
    jt.policy_loss(model, example, grpo_learner.GRPOConfig(num_generations=2), PAD)


def test_the_library_never_imports_tunix():
  """`import jaxrl_kernels` (and its models, nn) loads no Tunix module; no module outside
  jaxrl_kernels/integrations imports that package."""
  package = ROOT / "jaxrl_kernels"
  for path in package.rglob("*.py"):
    if package / "integrations" in path.parents:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      assert not any(n.startswith(("jaxrl_kernels.integrations", "tunix")) for n in names), path
  code = ("import sys, jaxrl_kernels, jaxrl_kernels.models, jaxrl_kernels.nn, "
          "jaxrl_kernels.integrations; "
          "assert not [m for m in sys.modules if m.split('.')[0] == 'tunix'], 'tunix loaded'")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]


def test_tunix_extra_pins_the_tested_version():
  with open(ROOT / "pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
  assert extras["tunix"] == [f"google-tunix=={jt.TUNIX_VERSION}"]
  assert importlib.metadata.version("google-tunix") == jt.TUNIX_VERSION
