"""Tunix GRPO on :class:`~jaxrl_kernels.models.DecoderLM`: the sampler's log-probs are the
trainer's, bit for bit.

Tested with ``google-tunix==0.1.7`` (``pip install jaxrl_kernels[tunix]``); Tunix's
interfaces change between releases.

A Tunix GRPO step makes a policy's per-token log-probs in up to four places: the rollout
engine's sampler, the actor's training step (inside the policy loss), the reference model
(for the KL) and, with ``num_iterations > 1``, the rollout model again (the old policy).
Stock Tunix computes the last three with ``tunix.rl.common.compute_per_token_logps`` (the
model's ``[B, T, V]`` logits and an XLA log-softmax) and the first in its sampler's decode
loop: programs of other shapes, so other bits. With ``num_iterations=1`` its GRPO loss takes
the trainer's own log-probs (under ``stop_gradient``) as the old policy's, so its ratio is 1
by construction and the sampler's numbers are never compared with the trainer's. Here all
four go through the same ``DecoderLM`` kernels (``nn.sample``; the model's forward and its
fused LM head), and the ratio is taken against the sampler's own log-probs:

* :class:`DecoderRollout`: Tunix's ``BaseRollout`` over :func:`jaxrl_kernels.nn.sample`;
  pass the class as ``ClusterConfig(rollout_engine=DecoderRollout)``.
* :class:`RLCluster`: Tunix's ``RLCluster`` whose reference log-probs come from the
  reference ``DecoderLM`` (:func:`completion_logp`).
* :class:`GRPOLearner`: Tunix's ``GRPOLearner`` that installs :func:`policy_loss` as the
  actor trainer's loss (``Trainer.with_loss_fn``, the call Tunix's learner makes itself)
  and puts the sampler's log-probs into ``TrainExample.old_per_token_logps``.

Every step logs, beside Tunix's ``kl`` and ``pg_clipfrac``: Tunix's ratio metrics
``is_ratio/min``, ``is_ratio/max`` and ``log_ratio/abs_mean`` (now the trainer against the
sampler), and ``logp_mismatch/max_abs`` (the largest ``|trainer - sampler|`` over the
completion tokens) and ``logp_mismatch/tokens`` (how many completion tokens have other raw
bits). At the first update after each rollout (every update with ``num_iterations=1`` and
one mini-batch per batch) the weights are the sampler's, so these are 1, 1, 0, 0 and 0.

Tunix's batches: prompts left-padded with the pad id (``prompt_ids [B, P]``), completions
right-padded with it (``completion_ids [B, N]``, the eos left out), ``completion_mask =
completion_ids != pad``. The pad id must not occur in a prompt (Tunix's masks would drop it;
:meth:`DecoderRollout.generate` refuses such prompts).

Not covered (each refused with an error): sequence packing
(``max_seq_token_per_tpu``), ``loss_algo="gspo-token"``, the loss aggregation modes other
than ``"token-mean"`` and ``"sequence-mean-token-mean"``, ``kl_clamp_value``,
``offload_to_cpu``, critic and reward models, meshes of more than one device, and the
agentic learners. Nothing in Tunix is patched.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxrl_kernels import nn
from jaxrl_kernels.models import DecoderLM
from jaxrl_kernels.reduce.masked import masked_mean

try:
  from tunix.generate import tokenizer_adapter
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl import utils as rl_utils
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout
except ImportError as e:  # pragma: no cover - exercised without the extra
  raise ImportError("jaxrl_kernels.integrations.tunix needs Tunix "
                    "(pip install jaxrl_kernels[tunix], google-tunix==0.1.7)") from e

TUNIX_VERSION = "0.1.7"  # the release this module is tested with

# Tunix's loss_agg_mode -> rl.policy_loss's token_level: the two reductions both define.
_AGGREGATION = {"token-mean": True, "sequence-mean-token-mean": False}
# Tunix's kl_loss_mode -> rl.kl's kind (Schulman's estimators, with d = ref - logp).
_KL_KINDS = {"kl": "k1", "mse_kl": "k2", "low_var_kl": "k3"}

#: The metrics this module's learner logs per step beside Tunix's ``kl`` and
#: ``pg_clipfrac``, with the reduction over a step's micro-batches.
METRICS: dict[str, Callable] = {
    "is_ratio/min": np.min,
    "is_ratio/max": np.max,
    "log_ratio/abs_mean": np.mean,
    "logp_mismatch/max_abs": np.max,
    "logp_mismatch/tokens": np.sum,
}


# ----------------------------------------------------------------------------- log-probs


def _sequence(prompt_ids, completion_ids, pad_id: int):
  """Tunix's batch as the model's inputs: ``(tokens, targets, positions)``, each
  ``[B, P + N - 1]`` (column ``j`` predicts token ``j + 1``); the left padding gets
  negative positions (padding to the model), so a prompt starts at position 0."""
  p, n = prompt_ids.shape[1], completion_ids.shape[1]
  pad = p - jnp.sum(prompt_ids != pad_id, axis=1, dtype=jnp.int32)
  seq = jnp.concatenate([prompt_ids, completion_ids], axis=1).astype(jnp.int32)
  positions = jnp.arange(p + n - 1, dtype=jnp.int32)[None, :] - pad[:, None]
  return seq[:, :-1], seq[:, 1:], positions


def _check_batch(fn: str, prompt_ids, completion_ids) -> None:
  if prompt_ids.ndim != 2 or completion_ids.ndim != 2 or (
      prompt_ids.shape[0] != completion_ids.shape[0]):
    raise ValueError(f"{fn}: prompt_ids and completion_ids must be [B, P] and [B, N], got "
                     f"{prompt_ids.shape} and {completion_ids.shape}")
  if prompt_ids.shape[1] == 0:
    raise ValueError(f"{fn}: prompt_ids has no column (Tunix's packed layout, "
                     f"max_seq_token_per_tpu, is not covered)")


def _completion_hidden(model: DecoderLM, prompt_ids, completion_ids, pad_id: int):
  """``(h [B, N, H], targets [B, N])``: the final hidden state that predicts each completion
  token, from one forward over prompt and completion."""
  tokens, targets, positions = _sequence(prompt_ids, completion_ids, pad_id)
  p = prompt_ids.shape[1]
  return model(tokens, positions)[:, p - 1:], targets[:, p - 1:]


@functools.partial(nnx.jit, static_argnames=("pad_id", "temperature"))
def _completion_logp(model, prompt_ids, completion_ids, *, pad_id: int, temperature: float):
  h, targets = _completion_hidden(model, prompt_ids, completion_ids, pad_id)
  return model.head(h, targets, completion_ids != pad_id, temperature=temperature)


def completion_logp(model: DecoderLM, prompt_ids, completion_ids, *, pad_id: int,
                    temperature: float = 1.0) -> jax.Array:
  """float32 ``[B, N]`` log-probs of Tunix's completion tokens under ``model``, 0 at pads.

  ``prompt_ids [B, P]`` left-padded and ``completion_ids [B, N]`` right-padded with
  ``pad_id`` (Tunix's ``TrainExample`` layout). One forward of ``model`` over each row's
  prompt and completion, then the fused head on the completion positions: bitwise the
  log-probs :func:`jaxrl_kernels.nn.sample` reported for the same tokens, and those the
  training step's :func:`policy_loss` computes.
  """
  if not isinstance(model, DecoderLM):
    raise TypeError(f"completion_logp: model must be a jaxrl_kernels DecoderLM, got "
                    f"{type(model).__name__}")
  prompt_ids, completion_ids = jnp.asarray(prompt_ids), jnp.asarray(completion_ids)
  _check_batch("completion_logp", prompt_ids, completion_ids)
  return _completion_logp(model, prompt_ids, completion_ids, pad_id=int(pad_id),
                          temperature=float(temperature))


# ----------------------------------------------------------------------------- the loss


def _objective(algo_config) -> dict[str, Any]:
  """Tunix's GRPO settings as :func:`jaxrl_kernels.rl.policy_loss` arguments."""
  fn = "jaxrl_kernels.integrations.tunix"
  loss_algo = getattr(algo_config, "loss_algo", "grpo")
  if loss_algo != "grpo":
    raise ValueError(f"{fn}: algo_config.loss_algo must be 'grpo', got {loss_algo!r}")
  mode = algo_config.loss_agg_mode
  if mode not in _AGGREGATION:
    raise ValueError(f"{fn}: algo_config.loss_agg_mode must be one of {sorted(_AGGREGATION)}, "
                     f"got {mode!r}")
  kl_mode = algo_config.kl_loss_mode
  if kl_mode not in _KL_KINDS:
    raise ValueError(f"{fn}: algo_config.kl_loss_mode must be one of {sorted(_KL_KINDS)}, got "
                     f"{kl_mode!r}")
  if getattr(algo_config, "kl_clamp_value", None) is not None:
    raise ValueError(f"{fn}: algo_config.kl_clamp_value must be None (the k3 estimator clamps "
                     f"its log-ratio at +-rl.LOG_RATIO_CLAMP), got {algo_config.kl_clamp_value!r}")
  return dict(clip_low=float(algo_config.epsilon),
              clip_high=float(getattr(algo_config, "epsilon_high", algo_config.epsilon)),
              dual_clip=getattr(algo_config, "epsilon_c", None),
              token_level=_AGGREGATION[mode], kl_kind=_KL_KINDS[kl_mode],
              beta=float(algo_config.beta))


def policy_loss(model: DecoderLM, train_example, algo_config,
                pad_id: int) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Tunix's GRPO objective on ``model``'s fused LM head: ``(loss, aux)``.

  The loss function :class:`GRPOLearner` installs in the actor trainer (Tunix's
  policy-loss arguments; completions end at their first pad, so no ``eos_id``). The clipped
  objective, the KL penalty and their reductions are :meth:`DecoderLM.policy_loss
  <jaxrl_kernels.models.DecoderLM.policy_loss>`'s (:func:`jaxrl_kernels.rl.policy_loss`
  fused into the head) with Tunix's settings: ``epsilon`` / ``epsilon_high`` the clip
  range, ``epsilon_c`` the dual clip, ``beta`` and ``kl_loss_mode`` (``"kl"``,
  ``"mse_kl"``, ``"low_var_kl"``: the k1, k2, k3 estimators) the KL, ``loss_agg_mode``
  ``"sequence-mean-token-mean"`` (Tunix's default) or ``"token-mean"``, ``temperature``
  the rollout's. The old policy is ``train_example.old_per_token_logps``: the sampler's
  log-probs (:class:`GRPOLearner` sets them), never the trainer's own.

  ``aux``: Tunix's keys ``kl`` (token mean, 0 without a reference), ``pg_loss``,
  ``pg_clipfrac``, ``is_ratio/mean|min|max``, ``log_ratio/abs_mean``, ``entropy`` (token
  mean), and ``logp_mismatch/max_abs``, ``logp_mismatch/tokens`` (trainer against sampler,
  on raw bits) and ``per_token_logps`` (the trainer's ``[B, N]``, no gradient).
  """
  if not isinstance(model, DecoderLM):
    raise TypeError(f"policy_loss: the actor must be a jaxrl_kernels DecoderLM, got "
                    f"{type(model).__name__}")
  if getattr(train_example, "segment_ids", None) is not None:
    raise ValueError("policy_loss: packed examples (training_config.max_seq_token_per_tpu) "
                     "are not covered")
  if getattr(train_example, "sampler_is_weights", None) is not None:
    raise ValueError("policy_loss: train_example.sampler_is_weights must be None (the "
                     "sampler's log-probs are the trainer's: there is nothing to correct)")
  old = train_example.old_per_token_logps
  if old is None:
    raise ValueError("policy_loss: train_example.old_per_token_logps is None; it must hold "
                     "the sampler's log-probs (use jaxrl_kernels.integrations.tunix."
                     "GRPOLearner)")
  opts = _objective(algo_config)
  prompt_ids, completion_ids = train_example.prompt_ids, train_example.completion_ids
  _check_batch("policy_loss", prompt_ids, completion_ids)
  mask = train_example.completion_mask.astype(bool)
  if old.shape != mask.shape:
    raise ValueError(f"policy_loss: old_per_token_logps must have the completions' shape "
                     f"{mask.shape}, got {old.shape}")
  ref = train_example.ref_per_token_logps
  if ref is None:
    opts["beta"] = 0.0
  h, targets = _completion_hidden(model, prompt_ids, completion_ids, pad_id)
  loss, m = model.head.policy_loss(
      h, targets, mask, temperature=float(algo_config.temperature), old_logp=old,
      advantages=train_example.advantages, ref_logp=ref, **opts)
  logp, sampled = m["logp"], old.astype(jnp.float32)
  differ = mask & (lax.bitcast_convert_type(logp, jnp.uint32)
                   != lax.bitcast_convert_type(sampled, jnp.uint32))
  abs_diff = jnp.abs(logp - jnp.where(mask, sampled, 0.0))
  aux = {
      "kl": m.get("kl", jnp.float32(0.0)),
      "pg_loss": m["pg_loss"],
      "pg_clipfrac": m["clipfrac"],
      "is_ratio/mean": m["ratio_mean"],
      "is_ratio/min": m["ratio_min"],
      "is_ratio/max": m["ratio_max"],
      "log_ratio/abs_mean": masked_mean(abs_diff, mask),
      "entropy": masked_mean(m["entropy"], mask),
      "logp_mismatch/max_abs": jnp.max(jnp.where(mask, abs_diff, 0.0), initial=0.0),
      "logp_mismatch/tokens": jnp.sum(differ, dtype=jnp.int32),
      "per_token_logps": logp,
  }
  return loss, aux


# ----------------------------------------------------------------------------- rollout


def _one_device(fn: str, mesh) -> None:
  if mesh is not None and math.prod(mesh.devices.shape) != 1:
    raise ValueError(f"{fn}: mesh has {math.prod(mesh.devices.shape)} devices; this "
                     f"integration runs the unsharded DecoderLM, on a one-device mesh")


class DecoderRollout(base_rollout.BaseRollout):
  """Tunix's rollout engine over :func:`jaxrl_kernels.nn.sample` on a ``DecoderLM``.

  Pass the class as ``ClusterConfig(rollout_engine=DecoderRollout)``; Tunix's
  ``RLCluster`` builds it with ``rollout_actor`` (the actor's model itself when the actor
  and rollout meshes are one: the sampler then reads the trained weights in place),
  ``tokenizer`` (any tokenizer Tunix's ``TokenizerAdapter`` takes), ``mesh`` and the
  training ``rollout_config``. ``seed`` keys the draws when ``rollout_config.seed`` is None:
  call ``i`` of :meth:`generate` uses ``fold_in(key(seed), i)`` (Tunix's sampler would reuse
  ``PRNGKey(0)`` every call).

  :meth:`generate` follows Tunix's sampler: each prompt encoded with a leading bos
  (``bos_id()``, when the tokenizer has one), left-padded to
  ``rollout_config.max_prompt_length`` (or the next power of two of the longest prompt, if
  longer), completions of up to ``max_tokens_to_generate`` tokens that stop at
  ``eos_tokens`` (default the tokenizer's eos) and are returned without it.
  ``temperature`` must be > 0 (Tunix's 0, greedy, has no log-probs to agree on); ``top_k``
  (<= 0 or None: off) and ``top_p`` (1 or None: off) change which token is drawn, not its
  reported log-prob (the full softmax's, as the trainer's). Each completion's log-probs
  (float32, one per returned token) are in ``RolloutOutput.logprobs`` when
  ``return_logprobs`` is set, and kept for :meth:`pop_sampled_logprobs` in any case.
  """

  def __init__(self, rollout_actor: DecoderLM, tokenizer: Any, mesh=None,
               rollout_config: base_rollout.RolloutConfig | None = None, *, seed: int = 0):
    if not isinstance(rollout_actor, DecoderLM):
      raise TypeError(f"DecoderRollout: rollout_actor must be a jaxrl_kernels DecoderLM, got "
                      f"{type(rollout_actor).__name__}")
    if tokenizer is None:
      raise ValueError("DecoderRollout: tokenizer is None; the rollout encodes Tunix's "
                       "string prompts")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
      raise TypeError(f"DecoderRollout: seed must be an int, got {seed!r}")
    _one_device("DecoderRollout", mesh)
    self._model = rollout_actor
    self._tokenizer = (tokenizer if isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter)
                       else tokenizer_adapter.TokenizerAdapter(tokenizer))
    self._key = jax.random.key(int(seed))
    self._calls = 0
    self._temperature = None if rollout_config is None else rollout_config.temperature
    self._sampled: list[np.ndarray] = []

  def _encode(self, prompts: Sequence[str]) -> list[np.ndarray]:
    tok, pad = self._tokenizer, self.pad_id()
    bos = tok.bos_id()
    out = []
    for i, text in enumerate(prompts):
      if not isinstance(text, str):
        raise TypeError(f"DecoderRollout.generate: prompts[{i}] must be a str, got "
                        f"{type(text).__name__}")
      ids = list(tok.encode(text))
      if bos:  # Tunix's sampler: a leading bos, never two
        ids = tok.dedup_bos_ids([bos] + ids)
      ids = np.asarray(ids, np.int32)
      if ids.size == 0:
        raise ValueError(f"DecoderRollout.generate: prompts[{i}] encodes to no tokens")
      if np.any(ids == pad):
        raise ValueError(f"DecoderRollout.generate: prompts[{i}] encodes to ids holding the "
                         f"pad id {pad}; Tunix's learner reads pad ids in a prompt as padding")
      out.append(ids)
    return out

  def _draw_key(self, seed) -> jax.Array:
    if seed is None:
      key = jax.random.fold_in(self._key, self._calls)
    elif isinstance(seed, int | np.integer) and not isinstance(seed, bool):
      key = jax.random.key(int(seed))
    else:
      key = seed  # a PRNG key, as Tunix's sampler takes it
    self._calls += 1
    return key

  def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
               **kwargs) -> base_rollout.RolloutOutput:
    """Samples one completion per prompt (Tunix repeats a GRPO group's prompt itself)."""
    cfg = rollout_config
    if not prompts:
      raise ValueError("DecoderRollout.generate: prompts is empty")
    if not cfg.temperature or cfg.temperature <= 0:
      raise ValueError(f"DecoderRollout.generate: rollout_config.temperature must be > 0, got "
                       f"{cfg.temperature!r} (Tunix's 0 means greedy decoding)")
    top_k = None if cfg.top_k is None or cfg.top_k <= 0 else cfg.top_k  # Tunix: <= 0 is off
    top_p = None if cfg.top_p is None or cfg.top_p == 1 else cfg.top_p
    eos = tuple(int(t) for t in (cfg.eos_tokens or [self.eos_id()]))
    ids = self._encode(prompts)
    longest = max(len(x) for x in ids)
    width = cfg.max_prompt_length
    if width is None or width < longest:  # Tunix's sampler widens the prompts the same way
      width = 1 << (longest - 1).bit_length()
    b, n = len(ids), int(cfg.max_tokens_to_generate)
    right = np.zeros((b, width), np.int32)
    left = np.full((b, width), self.pad_id(), np.int32)
    lengths = np.array([len(x) for x in ids], np.int32)
    for r, x in enumerate(ids):
      right[r, :len(x)] = x
      left[r, width - len(x):] = x
    res = nn.sample(self._model, right, lengths, max_new_tokens=n,
                    key=self._draw_key(cfg.seed), temperature=float(cfg.temperature),
                    stop_ids=eos, top_k=top_k, top_p=top_p)
    self._temperature = cfg.temperature
    tokens, logp = np.asarray(res.tokens), np.asarray(res.logp)
    done = np.asarray(res.completion_mask).sum(axis=1)
    out_tokens, out_logp = [], []
    for r in range(b):
      start = lengths[r]
      comp = tokens[r, start:start + done[r]]
      stop = np.flatnonzero(np.isin(comp, eos))
      end = int(stop[0]) if stop.size else len(comp)  # the eos is left out, as Tunix does
      out_tokens.append(comp[:end])
      out_logp.append(logp[r, start:start + end].copy())
    self._sampled.extend(out_logp)
    return base_rollout.RolloutOutput(
        text=[self._tokenizer.decode(t.tolist()) for t in out_tokens], logits=None,
        tokens=out_tokens, left_padded_prompt_tokens=left,
        logprobs=list(out_logp) if cfg.return_logprobs else None)

  def pop_sampled_logprobs(self) -> list[np.ndarray]:
    """The float32 log-probs of every completion :meth:`generate` returned since the last
    call, in order (one array per completion, one value per token), and forgets them."""
    out, self._sampled = self._sampled, []
    return out

  def get_per_token_logps(self, prompt_tokens: jax.Array,
                          completion_tokens: jax.Array) -> jax.Array:
    """:func:`completion_logp` of the rollout model at the rollout temperature (the last
    :meth:`generate`'s, else the constructor's ``rollout_config``'s)."""
    if self._temperature is None:
      raise ValueError("DecoderRollout.get_per_token_logps: no temperature yet: build the "
                       "rollout with a rollout_config or call generate first")
    return completion_logp(self._model, prompt_tokens, completion_tokens, pad_id=self.pad_id(),
                           temperature=float(self._temperature))

  def update_params(self, params, filter_types: tuple | None = None) -> None:
    """Puts the trainer's parameters (an ``nnx.State`` of the same model) into the rollout
    model, each onto the device of the array it replaces. The dtypes must be the rollout
    model's: log-probs agree only when both sides compute in one dtype."""
    dst = nnx.state(self._model, *(filter_types or (nnx.Param,)))
    if jax.tree.structure(params) != jax.tree.structure(dst):
      raise ValueError("DecoderRollout.update_params: params must be the state of a model of "
                       "the rollout model's architecture (their trees differ)")

    def put(new, old):
      if new.dtype != old.dtype or new.shape != old.shape:
        raise ValueError(f"DecoderRollout.update_params: a parameter of {new.dtype} "
                         f"{new.shape} would replace one of {old.dtype} {old.shape}")
      return jax.device_put(new, old.sharding)

    nnx.update(self._model, jax.tree.map(put, params, dst))

  def pad_id(self) -> int:
    return self._tokenizer.pad_id()

  def eos_id(self) -> int:
    return self._tokenizer.eos_id()

  def model(self) -> DecoderLM:
    return self._model


# ----------------------------------------------------------------------------- cluster


def _rollout_class(engine) -> type | None:
  if isinstance(engine, functools.partial):
    engine = engine.func
  return engine if isinstance(engine, type) else None


class RLCluster(rl_cluster_lib.RLCluster):
  """Tunix's ``RLCluster`` for a ``DecoderLM`` actor and reference.

  The same arguments. The rollout engine must be :class:`DecoderRollout` (or a
  ``functools.partial`` of it); :meth:`get_ref_per_token_logps` scores with the reference
  ``DecoderLM`` (:func:`completion_logp`: the kernels of the actor's sampler and trainer,
  so the KL of the initial policy to itself is exactly 0).
  """

  def __init__(self, *, actor: DecoderLM, reference: DecoderLM | None = None,
               tokenizer: Any, cluster_config: rl_cluster_lib.ClusterConfig,
               critic=None, reward=None, perf_config=None):
    for name, model in (("critic", critic), ("reward", reward)):
      if model is not None:
        raise ValueError(f"RLCluster: a {name} model is not covered (GRPO uses neither)")
    if not isinstance(actor, DecoderLM):
      raise TypeError(f"RLCluster: actor must be a jaxrl_kernels DecoderLM, got "
                      f"{type(actor).__name__}")
    if reference is not None and not isinstance(reference, DecoderLM):
      raise TypeError(f"RLCluster: reference must be None or a jaxrl_kernels DecoderLM, got "
                      f"{type(reference).__name__}")
    engine = _rollout_class(cluster_config.rollout_engine)
    if engine is None or not issubclass(engine, DecoderRollout):
      raise ValueError(f"RLCluster: cluster_config.rollout_engine must be DecoderRollout, got "
                       f"{cluster_config.rollout_engine!r}")
    if cluster_config.offload_to_cpu:
      raise ValueError("RLCluster: cluster_config.offload_to_cpu is not covered")
    for role, mesh in cluster_config.role_to_mesh.items():
      _one_device(f"RLCluster: role_to_mesh[{role}]", mesh)
    super().__init__(actor=actor, reference=reference, tokenizer=tokenizer,
                     cluster_config=cluster_config, perf_config=perf_config)

  def get_ref_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array,
                              pad_id: int, eos_id: int,
                              micro_batch_size: int | None = None) -> jax.Array:
    """The reference model's :func:`completion_logp` at the rollout temperature, in
    micro-batches of ``micro_batch_size`` rows (``eos_id`` unused: completions end at the
    first pad)."""
    b = prompt_tokens.shape[0]
    if b == 0:
      raise ValueError("RLCluster.get_ref_per_token_logps: the batch is empty")
    model = self.inference_worker.get_model("reference")
    temperature = self.get_rollout_config(mode=rl_cluster_lib.Mode.TRAIN).temperature
    outs = [completion_logp(model, prompt_tokens[s], completion_tokens[s], pad_id=pad_id,
                            temperature=temperature)
            for s in rl_utils.chunk_slices_by_size(stop=b, step=micro_batch_size or b)]
    return jnp.concatenate(outs, axis=0)

  def get_actor_per_token_logps(self, *args, **kwargs):
    raise NotImplementedError("RLCluster.get_actor_per_token_logps (Tunix's agentic "
                              "learners) is not covered; GRPOLearner takes the sampler's "
                              "log-probs instead")


# ----------------------------------------------------------------------------- learner


class GRPOLearner(grpo_learner.GRPOLearner):
  """Tunix's ``GRPOLearner`` whose trainer computes the sampler's log-probs bit for bit.

  The same arguments; ``rl_cluster`` must be this module's :class:`RLCluster`. After
  Tunix's setup it installs :func:`policy_loss` as the actor trainer's loss
  (``actor_trainer.with_loss_fn``) and logs :data:`METRICS` beside Tunix's ``kl`` and
  ``pg_clipfrac``. Each rollout's ``TrainExample`` gets the sampler's log-probs as
  ``old_per_token_logps`` (0 past each completion), so the ratio of the loss is the
  trainer's log-prob against the sampler's.
  """

  def __init__(self, rl_cluster: RLCluster, algo_config: grpo_learner.GRPOConfig,
               reward_fns, metric_fns=None, data_shuffle_seed: int | None = None):
    if not isinstance(rl_cluster, RLCluster):
      raise TypeError(f"GRPOLearner: rl_cluster must be jaxrl_kernels.integrations.tunix."
                      f"RLCluster, got {type(rl_cluster).__name__}")
    _objective(algo_config)  # refuse what the loss does not cover before any rollout
    super().__init__(rl_cluster=rl_cluster, algo_config=algo_config, reward_fns=reward_fns,
                     metric_fns=metric_fns, data_shuffle_seed=data_shuffle_seed)
    pad_id = rl_cluster.rollout.pad_id()
    trainer = rl_cluster.actor_trainer
    trainer.with_loss_fn(
        lambda model, train_example, algo_config: policy_loss(
            model, train_example, self.algo_config, pad_id),
        has_aux=True)
    trainer.with_rl_metrics_to_log({**trainer.rl_metrics_to_log, **METRICS})

  def _generate_and_compute_advantage(self, training_input, mode=rl_cluster_lib.Mode.TRAIN):
    rollout = self.rl_cluster.rollout
    rollout.pop_sampled_logprobs()  # what a direct generate() call left
    example = super()._generate_and_compute_advantage(training_input, mode)
    sampled = rollout.pop_sampled_logprobs()
    b, n = example.completion_ids.shape
    if len(sampled) != b:
      raise RuntimeError(f"GRPOLearner: the rollout reported {len(sampled)} completions for a "
                         f"batch of {b}")
    old = np.zeros((b, n), np.float32)
    for r, lp in enumerate(sampled):
      old[r, :len(lp)] = lp
    return dataclasses.replace(example, old_per_token_logps=jnp.asarray(old))
