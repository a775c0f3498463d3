"""``jaxrl-kernels parity --rollout-tp N --train-fsdp M``: rollout sharded one way, training
another, the same bits?

The common RL layout: the rollout engine runs the policy tensor-parallel (TP = N, for
decode speed), the trainer runs it fully sharded (FSDP = M, for memory). :func:`tp_report`
samples completions with the KV-cache sampler (``nn.sample``) on the model sharded TP = N
(``models.shard``) and on the unsharded model, then recomputes every sampled token's
log-prob the way the trainer does (``nn.score``): on the model sharded FSDP = M (sequences
packed, ``M`` rows per call), and on the unsharded model (in chunks of another batch
size). It prints, per
(sampler, trainer) pairing, the max |Δlogp| and the fraction of sampled tokens whose
log-prob is bitwise the sampler's, for:

* **jaxrl_kernels**: the batch-invariant kernels, row-parallel layers in the canonical
  order (``merge="canonical"``), sampled at TP = N and unsharded;
* **psum merge** (the control for TP): the same model sampled at TP = N with
  Megatron row-parallel layers and head (``merge="psum"``), whose bits depend on N;
* **stock XLA** (the control for batch invariance): ``implementation="xla"`` (``jnp.dot``,
  XLA softmax attention, materialised logits), sampled unsharded (the stock path has no
  tensor-parallel head) and scored under FSDP = M and unsharded.

jaxrl_kernels passes when every one of its pairings is bitwise for every sampled token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl_kernels.models.config import PRESETS, DecoderConfig
from jaxrl_kernels.models.decoder import DecoderLM

#: The default model of the command: a two-layer Llama-style decoder small enough for a
#: CPU, with 8 key/value heads and 1000 ids so that every TP degree up to 8 splits it (the
#: last vocabulary shard holding a partial tile).
TINY = DecoderConfig(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                     head_dim=16)
MODEL_CHOICES = ("tiny", *sorted(PRESETS), "hf:PATH")


def model_config(spec: str, layers: int | None = None) -> DecoderConfig:
  """The architecture of ``spec`` (as :func:`build_model` takes it), read without building
  the model: ``config.json`` for ``"hf:PATH"``; ``layers`` replaces a preset's
  ``num_hidden_layers``."""
  if spec.startswith("hf:"):
    import json
    import os

    from jaxrl_kernels.models.config import from_hf_dict
    path = os.path.join(spec[3:], "config.json")
    try:
      with open(path) as f:
        return from_hf_dict(json.load(f))
    except (KeyError, AttributeError, TypeError) as e:  # a config.json of another shape
      raise ValueError(f"parity_tp: cannot read {path}: {type(e).__name__}: {e}") from None
  if spec == "tiny":
    return TINY
  if spec in PRESETS:
    return PRESETS[spec] if layers is None else dataclasses.replace(PRESETS[spec],
                                                                     num_hidden_layers=layers)
  raise ValueError(f"parity_tp: model must be one of {MODEL_CHOICES}, got {spec!r}")


def build_model(spec: str, *, dtype: str = "float32", implementation: str | None = None,
                seed: int = 0, layers: int | None = None) -> DecoderLM:
  """The :class:`~jaxrl_kernels.models.DecoderLM` named by ``spec``: ``"tiny"``
  (:data:`TINY`), a preset of ``models.PRESETS`` (random weights at the public shape) or
  ``"hf:PATH"`` (a local Hugging Face folder, ``models.from_pretrained``). Random weights
  come from ``seed``, so two calls differing only in ``implementation`` hold the same
  parameters; ``layers`` replaces a preset's ``num_hidden_layers``."""
  from jaxrl_kernels import models

  if spec.startswith("hf:"):
    return models.from_pretrained(spec[3:], dtype=dtype, implementation=implementation)
  if spec == "tiny":  # built here: aliases resolved, "auto" is float32
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "float32"}.get(
        dtype, dtype)
    return DecoderLM(TINY, dtype=dtype, implementation=implementation, rngs=nnx.Rngs(seed))
  if spec in PRESETS:
    extra = {} if layers is None else {"num_hidden_layers": layers}
    return models.preset(spec, seed, dtype, implementation=implementation, **extra)
  raise ValueError(f"parity_tp: model must be one of {MODEL_CHOICES}, got {spec!r}")


def check_layout(config: DecoderConfig, *, rollout_tp: int, train_fsdp: int,
                 num_devices: int) -> str | None:
  """Why ``rollout_tp`` / ``train_fsdp`` cannot run for ``config`` on ``num_devices``
  devices (a message naming the flag), or None when they can."""
  from jaxrl_kernels.linear_logp import padded_vocab_size
  from jaxrl_kernels.models import canonical_row_chunks

  for flag, n in (("--rollout-tp", rollout_tp), ("--train-fsdp", train_fsdp)):
    if n > num_devices:
      return (f"{flag} {n} needs {n} devices, JAX sees {num_devices}; --device cpu makes a "
              f"host mesh of {max(rollout_tp, train_fsdp)} CPU devices")
  tp = rollout_tp
  if tp > 1:
    if config.num_experts % tp:
      return (f"--rollout-tp {tp} must divide the model's {config.num_experts} experts (a "
              f"MoE layer's experts are split over the devices)")
    if config.num_key_value_heads % tp:
      return (f"--rollout-tp {tp} must divide the model's {config.num_key_value_heads} "
              f"key/value heads (GQA groups stay whole on a device)")
    o_chunks, down_chunks = canonical_row_chunks(config)
    if o_chunks % tp or down_chunks % tp:
      return (f"--rollout-tp {tp} must divide the model's canonical row-parallel K chunks "
              f"(o_proj {o_chunks}, down_proj {down_chunks}; models.canonical_row_chunks)")
    v_s = padded_vocab_size(config.vocab_size, tp) // tp
    if (tp - 1) * v_s >= config.vocab_size:
      return (f"--rollout-tp {tp} splits the model's {config.vocab_size} ids into shards of "
              f"{v_s} tile-aligned rows, the last holding only padding; use a smaller TP")
  return None


@dataclasses.dataclass(frozen=True)
class Pairing:
  """One (sampler, trainer) pairing's drift over the sampled tokens."""

  path: str
  sampler: str
  trainer: str
  tokens: int
  equal: int
  max_abs: float

  @property
  def bitwise(self) -> bool:
    return self.equal == self.tokens


def drift(path: str, sampler: str, trainer: str, sampled: np.ndarray, scored: np.ndarray,
          mask: np.ndarray) -> Pairing:
  """Tokens whose scored log-prob has the sampled one's bits, and the max |Δlogp|."""
  a = np.asarray(sampled, np.float32)[mask]
  b = np.asarray(scored, np.float32)[mask]
  equal = int(np.sum(a.view(np.uint32) == b.view(np.uint32)))
  return Pairing(path, sampler, trainer, int(a.size), equal,
                 float(np.max(np.abs(a - b))) if a.size else 0.0)


def table(rows: Sequence[Pairing]) -> str:
  """The drift table, one line per pairing."""
  w = [max(len(h), *(len(getattr(r, f)) for r in rows))
       for h, f in (("path", "path"), ("sampler", "sampler"), ("trainer", "trainer"))]
  lines = [f"  {'path':<{w[0]}}  {'sampler':<{w[1]}}  {'trainer':<{w[2]}}  bitwise  "
           f"equal tokens       max |dlogp|"]
  for r in rows:
    frac = f"{r.equal}/{r.tokens} ({100 * r.equal / max(r.tokens, 1):.0f}%)"
    lines.append(f"  {r.path:<{w[0]}}  {r.sampler:<{w[1]}}  {r.trainer:<{w[2]}}  "
                 f"{'yes' if r.bitwise else 'NO':<7}  {frac:<17}  {r.max_abs:.3e}")
  return "\n".join(lines)


def _mesh(devices, n: int, axis: str) -> Mesh:
  return Mesh(np.asarray(devices[:n], dtype=object), (axis,))


def tp_report(model: DecoderLM, *, rollout_tp: int, train_fsdp: int,
              stock_model: DecoderLM | None = None, devices: Sequence | None = None,
              seed: int = 0, batch: int = 4, prompt_len: int = 8, new_tokens: int = 8,
              temperature: float = 1.0, progress: Callable[[str], None] | None = None,
              label: str = "") -> bool:
  """Prints the drift table of sampling at TP = ``rollout_tp`` against training at
  FSDP = ``train_fsdp``; True iff every jaxrl_kernels pairing is bitwise.

  Args:
    model: the policy on the batch-invariant kernels (``implementation`` not ``"xla"``).
    rollout_tp: ``N >= 1``: the samplers' models are ``models.shard(model, tp=N)`` on the
      first ``N`` devices and ``model`` unsharded (and, with ``N > 1``, the
      ``merge="psum"`` control).
    train_fsdp: ``M >= 1``: the trainer's model is ``models.shard(model, fsdp=M)`` on the
      first ``M`` devices, scoring packed sequences ``M`` rows per call; the unsharded
      model scores them too, in chunks of ``max(1, batch // 3)`` rows.
    stock_model: the same weights with ``implementation="xla"`` (None: no stock rows).
    devices: the devices (default ``jax.devices()``).
    seed, batch, prompt_len, new_tokens, temperature: the rollout: ``batch`` prompts of
      ``prompt_len // 2 .. prompt_len`` random ids, ``new_tokens`` sampled per prompt.
    progress: called with a description before each stage (e.g. a progress bar's stage).
    label: the model's name for the header.
  """
  from jaxrl_kernels.models import Parallelism, shard
  from jaxrl_kernels.nn.sampler import sample, score

  devices = list(jax.devices() if devices is None else devices)
  problem = check_layout(model.config, rollout_tp=rollout_tp, train_fsdp=train_fsdp,
                         num_devices=len(devices))
  if problem:
    raise ValueError(f"tp_report: {problem}")
  if model.implementation == "xla":
    raise ValueError("tp_report: model must run the batch-invariant kernels, got "
                     "implementation='xla' (pass that one as stock_model)")
  stage = progress or (lambda _: None)
  n, m = rollout_tp, train_fsdp
  cfg = model.config
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
  lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, batch).astype(np.int32)
  key = jax.random.key(seed)
  tp_mesh, fsdp_mesh = _mesh(devices, n, "tp"), _mesh(devices, m, "fsdp")
  chunk = max(1, batch // 3)

  def rollout(sampler_model):
    r = sample(sampler_model, prompts, lengths, max_new_tokens=new_tokens, key=key,
               temperature=temperature)
    return tuple(np.asarray(x) for x in (r.logp, r.tokens, r.completion_mask))

  def trainers(path, sampler_name, trainer_fsdp, unsharded, logp, tokens, mask):
    stage(f"{path}: trainer FSDP={m} (packed, {m} rows per call)")
    rows = [drift(path, sampler_name, f"FSDP={m}, packed", logp,
                  score(trainer_fsdp, tokens, mask, temperature=temperature, pack=True,
                        batch_size=m), mask)]
    stage(f"{path}: trainer unsharded (chunks of {chunk})")
    rows.append(drift(path, sampler_name, f"unsharded, chunks of {chunk}", logp,
                      score(unsharded, tokens, mask, temperature=temperature,
                            batch_size=chunk), mask))
    return rows

  rows: list[Pairing] = []
  stage(f"jaxrl_kernels: sample at TP={n}")
  ours_fsdp = shard(model, Parallelism(fsdp_mesh, fsdp="fsdp"))
  logp, tokens, mask = rollout(shard(model, Parallelism(tp_mesh, tp="tp")))
  rows += trainers("jaxrl_kernels", f"TP={n}", ours_fsdp, model, logp, tokens, mask)
  # The unsharded sampler (nn.sample on the plain DecoderLM) must give the same bits too.
  stage("jaxrl_kernels: sample unsharded")
  logp, tokens, mask = rollout(model)
  rows += trainers("jaxrl_kernels", "unsharded", ours_fsdp, model, logp, tokens, mask)
  if n > 1:
    stage(f"psum merge: sample at TP={n}")
    logp, tokens, mask = rollout(shard(model, Parallelism(tp_mesh, tp="tp"), merge="psum"))
    rows += trainers("psum merge", f"TP={n}, psum", ours_fsdp, model, logp, tokens, mask)
  if stock_model is not None:
    stage("stock XLA: sample unsharded")
    logp, tokens, mask = rollout(stock_model)
    rows += trainers("stock XLA", "unsharded", shard(stock_model, Parallelism(
        fsdp_mesh, fsdp="fsdp")), stock_model, logp, tokens, mask)
  ok = all(r.bitwise for r in rows if r.path == "jaxrl_kernels")
  print(f"\n== rollout TP={n} vs training FSDP={m}: {label or cfg.model_type} "
        f"(V={cfg.vocab_size}, H={cfg.hidden_size}, layers={cfg.num_hidden_layers}, "
        f"{model.dtype.name})")
  print(f"data   {batch} prompts of {lengths.min()}-{prompt_len} tokens, {new_tokens} new "
        f"tokens each, temperature {temperature}")
  if n > 1 and stock_model is not None:
    print("stock XLA samples unsharded (the stock path has no tensor-parallel head)")
  print(table(rows))
  print(f"\nparity: jaxrl_kernels at TP={n} (rollout) vs FSDP={m} (training) is "
        + ("bitwise on-policy, every sampled token" if ok else "NOT bitwise on-policy here"))
  return ok
