"""``jaxrl-kernels parity``: are the sampler's and the trainer's log-probs the same bits?

Two sections:

1. **kernels** (also ``jaxrl-kernels kernels``): the same rows through
   ``det_matmul`` and ``jnp.dot`` at batch sizes 1 ... M, and the same tokens'
   log-probs through ``linear_logp`` and the materialised XLA path at several
   batch sizes; does any row's bits change?
2. **on-policy parity**: builds ``TinyCausalLM`` (fixed seed, or ``--params``),
   samples completions for ``--batch`` prompts with the KV-cache sampler
   (``nn.sampler.sample``: one token per step, batch B1), then recomputes every
   sampled token's log-prob as a trainer would (``nn.sampler.score``: one
   full-sequence forward, in chunks of another batch size, packed several
   sequences per row, and with ``--tp N`` a vocab-parallel head), for the stock
   XLA path (``implementation="xla"``) and for jaxrl_kernels, and prints
   ``logprob_drift`` of trainer vs sampler (max |dlogp|, approx_kl0, clipfrac0,
   bitwise, worst token).

With ``--rollout-tp N`` / ``--train-fsdp M``, or ``--model`` naming a Llama / Qwen
``DecoderLM`` (a ``models`` preset or ``hf:PATH``), only the sharded-model section runs
instead: sampled with the model tensor-parallel over N devices, scored fully sharded over
M devices and unsharded (:mod:`jaxrl_kernels.cli.parity_tp`). With ``--model-fn
module:function``, only a user's model function is checked, under ``batch_invariant``
(:mod:`jaxrl_kernels.cli.model_fn`).

Exit status 0 iff jaxrl_kernels is bitwise in every section that ran, 1 when it is not,
2 for arguments that cannot run here (said in one line before any work).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels import _backend
from jaxrl_kernels.contract import VOCAB_TILE
from jaxrl_kernels.models.config import PRESETS


def usage_error(message: str) -> None:
  """Stops the command with ``message`` on one line and exit status 2 (argparse's)."""
  print(f"jaxrl-kernels: error: {' '.join(str(message).split())}", file=sys.stderr)
  raise SystemExit(2)


#: What a bad argument or a bad input file raises while the library loads or checks it
#: (a missing or unreadable file, a value or a file's content it refuses): exit status 2.
INPUT_ERRORS = (OSError, ValueError, TypeError)


class Parser(argparse.ArgumentParser):
  """An ``ArgumentParser`` whose errors are one line on stderr naming the flag, exit 2
  (argparse's own print the usage first)."""

  def parse_known_args(self, args=None, namespace=None):
    # argparse drops a value spelled "--" ("--seed=--" parses as an empty list).
    for a in sys.argv[1:] if args is None else args:
      if isinstance(a, str) and a.startswith("-") and a.endswith("=--"):
        self.error(f"argument {a.split('=', 1)[0]}: expected a value, got '--'")
    return super().parse_known_args(args, namespace)

  def error(self, message: str):
    print(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} -h)",
          file=sys.stderr)
    raise SystemExit(2)


# ------------------------------------------------------------------------------ kernels


def _wide_rows(key, m, k, dtype):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (m, k), jnp.float32)
  scale = 2.0 ** jax.random.randint(k2, (m, 1), -10, 11).astype(jnp.float32)
  return (x * scale).astype(dtype)


def _sweep(fn, x, sizes):
  """Max |delta| and bitwise flag of ``fn(x[:m])`` rows against ``fn(x)`` rows."""
  full = np.asarray(fn(x), np.float32)
  worst, same = 0.0, True
  for m in sizes:
    part = np.asarray(fn(x[:m]), np.float32)
    same &= bool(np.array_equal(part.view(np.uint32), full[:m].view(np.uint32)))
    worst = max(worst, float(np.max(np.abs(part - full[:m]))))
  return same, worst


def gemm_check(impl: str | None, k: int, n: int, m_max: int, dtype) -> list[tuple]:
  from jaxrl_kernels import det_matmul
  from jaxrl_kernels.gemm.api import resolve_implementation
  x = _wide_rows(jax.random.key(0), m_max, k, dtype)
  w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
  sizes = [1 << i for i in range(m_max.bit_length()) if (1 << i) < m_max] + [m_max // 3 or 1]
  chosen = resolve_implementation(impl, jnp.dtype(dtype), n, k)
  rows = []
  for name, fn in ((f"det_matmul ({chosen})",
                    jax.jit(lambda a: det_matmul(a, w, implementation=chosen))),
                   ("jnp.dot (XLA)", jax.jit(lambda a: jnp.dot(a, w)))):
    t0 = time.perf_counter()
    same, worst = _sweep(fn, x, sizes)
    rows.append((name, same, worst, time.perf_counter() - t0))
  return rows


def logp_check(impl: str | None, h: int, v: int, t_max: int, dtype):
  from jaxrl_kernels import linear_logp, logprob_drift
  x = _wide_rows(jax.random.key(2), t_max, h, dtype)
  x = (x.astype(jnp.float32) * 2.0**-6).astype(dtype)
  w = (jax.random.normal(jax.random.key(3), (h, v), jnp.float32) * 0.1).astype(dtype)
  tg = jax.random.randint(jax.random.key(4), (t_max,), 0, v)
  sizes = (1, 7, t_max // 2)
  out = {}
  for name, impl_name in (("linear_logp", impl), ("XLA log_softmax", "xla")):
    fn = jax.jit(lambda a, t, impl_name=impl_name: linear_logp(a, w, t,
                                                               implementation=impl_name))
    full = np.asarray(fn(x, tg))
    alone = np.concatenate([np.asarray(fn(x[s:s + m], tg[s:s + m]))
                            for s, m in zip((0, 1, 8), sizes)])
    idx = np.concatenate([np.arange(s, s + m) for s, m in zip((0, 1, 8), sizes)])
    out[name] = logprob_drift(alone, full[idx], np.asarray(tg)[idx])
  return out


def kernels_report(args) -> bool:
  """Prints the GEMM and ``linear_logp`` batch-invariance section; True iff bitwise."""
  dtype = jnp.dtype(args.dtype)
  on_gpu = _backend.platform() == "gpu"
  k, n, m_max = (4096, 4096, 1024) if on_gpu else (256, 256, 256)
  h, v, t_max = (1024, 32000, 256) if on_gpu else (64, 1000, 64)
  print(f"== kernels: batch invariance ({dtype.name})")
  print(f"GEMM rows at batch sizes 1 ... {m_max} (K={k}, N={n}) vs the same rows at M={m_max}:")
  print(f"  {'op':<26} {'bitwise':<8} {'max |delta|':<12} time")
  ok = True
  for i, (name, same, worst, secs) in enumerate(gemm_check(args.implementation, k, n, m_max,
                                                           dtype)):
    print(f"  {name:<26} {'yes' if same else 'NO':<8} {worst:<12.3g} {secs:.1f}s")
    if i == 0:
      ok &= same
  print(f"log-probs of tokens in batches of 1, 7, {t_max // 2} vs in one batch of {t_max} "
        f"(H={h}, V={v}):")
  for name, r in logp_check(args.implementation, h, v, t_max, dtype).items():
    print(f"  {name:<26} {'yes' if r.bitwise_equal else 'NO':<8} {r.max_abs_error:<12.3g}")
    if name == "linear_logp":
      ok &= r.bitwise_equal
  print("kernels: jaxrl_kernels is " + ("bitwise batch-invariant on this device"
                                          if ok else "NOT bitwise batch-invariant here"))
  return ok


# ------------------------------------------------------------------------------ parity


class Progress:
  """A ``rich`` progress bar over the parity stages; plain prints without ``rich``."""

  def __init__(self, total: int):
    self.total, self.done = total, 0
    try:
      from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
      self._bar = None
    else:
      self._bar = Progress(TextColumn("{task.description:<44}"), BarColumn(),
                           TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
      self._task = self._bar.add_task("parity", total=total)

  def __enter__(self):
    if self._bar is not None:
      self._bar.start()
    return self

  def __exit__(self, *exc):
    if self._bar is not None:
      self._bar.stop()

  def stage(self, description: str):
    """Announces the next stage; the previous one is counted done."""
    if self._bar is not None:
      self._bar.update(self._task, description=description, completed=self.done)
    else:
      print(f"[{self.done + 1}/{self.total}] {description}", flush=True)
    self.done += 1

  def finish(self):
    if self._bar is not None:
      self._bar.update(self._task, description="done", completed=self.total)


def _variants(batch: int, tp: int) -> list[tuple[str, dict]]:
  """How the trainer recomputes the log-probs: (label, ``score`` keywords)."""
  b2 = max(1, batch // 3) if batch > 1 else 1
  out = [(f"chunks of {b2} rows (B2 != B1, last chunk padded)", dict(batch_size=b2)),
         ("packed 2T-wide rows, 2 rows per call", dict(pack=True, batch_size=2))]
  if tp > 1:
    out.append((f"vocab-parallel head, TP={tp}, packed", dict(pack=True, tp=tp)))
  return out


def check_params(cfg, path: str) -> None:
  """Loads ``--params`` into a model of ``cfg`` once, before any work; a file that is not
  a checkpoint of that model stops the command (exit 2, the reason in one line)."""
  from flax import nnx

  from jaxrl_kernels.nn.tiny_lm import TinyCausalLM
  try:
    _load_params(TinyCausalLM(cfg, rngs=nnx.Rngs(0)), path)
  except (*INPUT_ERRORS, ImportError, KeyError, AttributeError) as e:  # a file of any shape
    usage_error(f"--params {path}: {e}")


def _load_params(model, path: str):
  from jaxrl_kernels.nn import checkpoint
  loaded = checkpoint.load_params(model, path)
  return model if loaded is None else loaded


def _shard_columns(vocab_size: int, tp: int) -> int:
  """Columns per vocab shard: the fewest whole ``VOCAB_TILE`` tiles covering ``vocab_size``."""
  return -(-vocab_size // (tp * VOCAB_TILE)) * VOCAB_TILE


def tp_vocab_size(vocab_size: int, tp: int) -> int | None:
  """The vocabulary the head is padded to for ``tp`` vocab shards, or None if none works.

  Shards are whole ``VOCAB_TILE``-wide tiles (``V_s`` columns each, the padding at the
  end), and every shard must hold at least one real id: ``(tp - 1) * V_s < vocab_size``.
  """
  v_s = _shard_columns(vocab_size, tp)
  return tp * v_s if (tp - 1) * v_s < vocab_size else None


def model_vocab_size(preset_vocab: int, vocab_size: int | None, tp: int) -> int:
  """The model's vocabulary: ``--vocab-size``, or the preset's rounded up to a multiple of
  ``tp * VOCAB_TILE`` when ``--tp`` needs it (that one always splits). Stops with a
  one-line error (before any work) when ``--vocab-size`` cannot be split over ``--tp``."""
  if tp == 1:
    return preset_vocab if vocab_size is None else vocab_size
  if vocab_size is None:
    return preset_vocab if tp_vocab_size(preset_vocab, tp) else (
        tp * _shard_columns(preset_vocab, tp))
  if tp_vocab_size(vocab_size, tp) is None:
    v_s = _shard_columns(vocab_size, tp)
    usage_error(f"--vocab-size {vocab_size} cannot be split over --tp {tp}: shards are "
                f"{VOCAB_TILE}-column tiles, so the last of {tp} shards of {v_s} would hold "
                f"only padding; use --vocab-size > {(tp - 1) * v_s}, or leave it out")
  return vocab_size


def tp_mesh(tp: int, device: str | None = None) -> jax.sharding.Mesh | None:
  """A 1-axis ``("tp",)`` mesh over the first ``tp`` devices (None for ``tp == 1``); stops
  with a one-line error saying what to do when JAX sees fewer devices."""
  if tp == 1:
    return None
  devs = jax.devices()
  if len(devs) < tp:
    hint = (f"--device cpu makes a host mesh of {tp} CPU devices" if device != "cpu" else
            f"JAX started before --device could add them: set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={tp} before starting Python")
    usage_error(f"--tp {tp} needs {tp} devices, JAX sees {len(devs)} ({devs[0].platform}); "
                f"{hint}")
  return jax.sharding.Mesh(np.asarray(devs[:tp]), ("tp",))


def parity_report(args, mesh: jax.sharding.Mesh | None = None) -> bool:
  """Prints the on-policy parity section; True iff jaxrl_kernels is bitwise.

  ``mesh`` is the vocab-parallel head's mesh when ``args.tp > 1`` (:func:`tp_mesh`).
  """
  from flax import nnx

  from jaxrl_kernels.diagnostics import logprob_drift
  from jaxrl_kernels.nn.sampler import sample, score
  from jaxrl_kernels.nn.tiny_lm import TinyCausalLM, TinyLMConfig

  preset = TinyLMConfig.preset(args.model)
  vocab = model_vocab_size(preset.vocab_size, args.vocab_size, args.tp)
  cfg = TinyLMConfig.preset(args.model, dtype=plain_dtype("--model-dtype", args.model_dtype,
                                                           "float32"), vocab_size=vocab)
  if args.tp > 1 and mesh is None:
    mesh = tp_mesh(args.tp, args.device)
  rng = np.random.default_rng(args.seed)
  b, p, n = args.batch, args.prompt_len, args.new_tokens
  prompts = rng.integers(0, cfg.vocab_size, (b, p)).astype(np.int32)
  prompt_lengths = rng.integers(max(1, p // 2), p + 1, b).astype(np.int32)
  variants = _variants(b, args.tp)
  print(f"\n== on-policy parity: KV-cache sampler (batch {b}) vs trainer forward")
  padded = (f" ({preset.vocab_size} padded for TP={args.tp})"
            if args.vocab_size is None and vocab != preset.vocab_size else "")
  print(f"model  TinyCausalLM {args.model!r}: V={cfg.vocab_size}{padded}, H={cfg.hidden}, "
        f"layers={cfg.num_layers}, heads={cfg.num_heads}, {cfg.dtype}"
        + (f", params from {args.params}" if args.params else f", seed {args.seed}"))
  print(f"data   {b} prompts of {prompt_lengths.min()}-{p} tokens, {n} new tokens each, "
        f"temperature {args.temperature}")
  print("trainer recomputations:\n" + "\n".join(f"  {i}. {v}" for i, (v, _) in
                                                enumerate(variants, 1)))
  paths = (("stock XLA", "xla"), ("jaxrl_kernels", args.implementation))
  reports = {}
  with Progress(len(paths) * (2 + len(variants))) as bar:
    for label, impl in paths:
      bar.stage(f"{label}: build model")
      model = TinyCausalLM(dataclasses.replace(cfg, implementation=impl),
                           rngs=nnx.Rngs(args.seed))
      if args.params:
        model = _load_params(model, args.params)
      bar.stage(f"{label}: sample (KV cache)")
      res = sample(model, prompts, prompt_lengths, max_new_tokens=n,
                   key=jax.random.key(args.seed), temperature=args.temperature)
      ref, tokens, mask = (np.asarray(x) for x in (res.logp, res.tokens, res.completion_mask))
      cands = []
      for i, (_, kw) in enumerate(variants, 1):
        bar.stage(f"{label}: trainer recompute {i}/{len(variants)}")
        kw = dict(kw)
        if kw.pop("tp", None):
          kw["tp_mesh"] = mesh
        cands.append(score(model, tokens, mask, temperature=args.temperature, **kw))
      reports[label] = [logprob_drift(c, ref, tokens, mask) for c in cands]
      stack = len(cands)
      reports[label].append(logprob_drift(
          np.stack(cands), np.broadcast_to(ref, (stack, *ref.shape)),
          np.broadcast_to(tokens, (stack, *ref.shape)),
          np.broadcast_to(mask, (stack, *ref.shape))))
    bar.finish()
  for label, _ in paths:
    *per, total = reports[label]
    print(f"\n-- {label}: trainer vs sampler log-probs of the {per[0].num_active} sampled "
          f"tokens")
    for i, r in enumerate(per, 1):
      print(f"  {i}. bitwise {'yes' if r.bitwise_equal else 'NO ':<3}  max |d| "
            f"{r.max_abs_error:.3e}  approx_kl0 {r.approx_kl0:.3e}  clipfrac0 {r.clipfrac0:.4f}")
    print("all recomputations (worst token index: [recomputation - 1, row, column]):")
    print(total.table())
  ok = all(r.bitwise_equal for r in reports["jaxrl_kernels"])
  print("\nparity: jaxrl_kernels is " + ("bitwise on-policy (trainer log-probs == sampler "
                                           "log-probs, every token)" if ok
                                           else "NOT bitwise on-policy here"))
  return ok


# ------------------------------------------------------------------------------ CLI


TINY_LM_PRESETS = ("test", "tiny", "small")


def int_at_least(minimum: int, why: str = ""):
  """An argparse type: an int >= ``minimum`` (argparse names the flag in its error; ``why``
  follows the bound in the message)."""

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      value = None
    if value is None or value < minimum:
      raise argparse.ArgumentTypeError(f"must be an int >= {minimum}{why}, got {text!r}")
    return value

  return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)

SEED_MAX = 2**32 - 1


def seed(text: str) -> int:
  """argparse type: a seed in ``[0, 2**32 - 1]`` (numpy's and ``jax.random.key``'s range)."""
  try:
    value = int(text)
  except ValueError:
    value = None
  if value is None or not 0 <= value <= SEED_MAX:
    raise argparse.ArgumentTypeError(f"must be an int in [0, {SEED_MAX}], got {text!r}")
  return value


def temperature(text: str) -> float:
  """argparse type: a sampling temperature (``_validation.as_temperature``: finite, > 0,
  its reciprocal finite in float32)."""
  from jaxrl_kernels._validation import as_temperature
  try:
    return as_temperature("--temperature", float(text))
  except (TypeError, ValueError) as e:
    reason = str(e).split(": ", 1)[-1] if str(e).startswith("--temperature") else str(e)
    raise argparse.ArgumentTypeError(f"{reason} (from {text!r})") from None


def positive_float(text: str) -> float:
  """argparse type: a finite float > 0."""
  try:
    value = float(text)
  except ValueError:
    value = float("nan")
  if not (np.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
  return value


#: ``--model-dtype``: what ``models.from_pretrained`` / ``models.preset`` take, and the
#: common aliases (``auto``: the checkpoint's ``torch_dtype``). The strings go to the
#: library unchanged; the TinyCausalLM and the built-in DecoderLM read them by
#: :data:`DTYPE_ALIASES`.
MODEL_DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "auto")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def plain_dtype(flag: str, dtype: str | None, default: str) -> str:
  """A ``--model-dtype`` value for a model built here (not loaded from a checkpoint):
  aliases resolved, ``auto``/None as ``default``."""
  if dtype is None or dtype == "auto":
    return default
  return DTYPE_ALIASES.get(dtype, dtype)


def _model_spec(text: str) -> str:
  """argparse type: a TinyCausalLM preset, a models preset, or ``hf:PATH``."""
  if text in TINY_LM_PRESETS or text in PRESETS or (text.startswith("hf:") and len(text) > 3):
    return text
  raise argparse.ArgumentTypeError(
      f"must be one of {', '.join(TINY_LM_PRESETS + tuple(sorted(PRESETS)))} or hf:PATH, got "
      f"{text!r}")


def _model_fn_spec(text: str) -> str:
  """argparse type: ``module:function``."""
  module, _, fn = text.partition(":")
  if not module or not fn or ":" in fn:
    raise argparse.ArgumentTypeError(f"must be 'module:function', got {text!r}")
  return text


def add_kernel_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--implementation", default=None, choices=_backend.IMPLEMENTATIONS,
                 help="jaxrl_kernels' implementation (default: the device's default)")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                 help="dtype of the kernel section")
  p.add_argument("--device", default=None, choices=["cpu", "gpu"],
                 help="JAX platform to run on (default: JAX's default backend); with "
                      "--device cpu, --tp N makes a host mesh of N CPU devices")


def add_parity_arguments(p: argparse.ArgumentParser) -> None:
  add_kernel_arguments(p)
  p.add_argument("--model", default="tiny", type=_model_spec, metavar="MODEL",
                 help="test, tiny, small: a TinyCausalLM preset; a models preset "
                      f"({', '.join(sorted(PRESETS))}) or hf:PATH (a local Hugging Face "
                      "folder): a DecoderLM, checked as with --rollout-tp 1 --train-fsdp 1; "
                      "with --rollout-tp / --train-fsdp, tiny is a 2-layer DecoderLM")
  p.add_argument("--model-dtype", default="float32", choices=MODEL_DTYPES,
                 help="the model's dtype (parameters and activations; for hf:PATH the "
                      "activations, the parameters stay the checkpoint's); auto: the "
                      "checkpoint's torch_dtype (float32 for a model without one)")
  p.add_argument("--layers", type=positive_int, default=None, metavar="N",
                 help="num_hidden_layers of a models preset (a shallower copy with the "
                      "preset's widths, e.g. qwen3-30b-a3b with --layers 2)")
  p.add_argument("--vocab-size", type=int, default=None,
                 help="override the preset's vocabulary (default: the preset's, padded to a "
                      f"multiple of TP x {VOCAB_TILE} when --tp needs it)")
  p.add_argument("--params", default=None, metavar="PATH",
                 help="load parameters from a safetensors file or an orbax folder")
  p.add_argument("--seed", type=seed, default=0)
  p.add_argument("--batch", type=positive_int, default=8, help="prompts, the sampler's batch B1")
  p.add_argument("--prompt-len", type=positive_int, default=8)
  p.add_argument("--new-tokens", type=positive_int, default=16)
  p.add_argument("--temperature", type=temperature, default=1.0)
  p.add_argument("--tp", type=positive_int, default=1,
                 help="also recompute with the LM head vocab-parallel over N devices")
  p.add_argument("--rollout-tp", type=positive_int, default=None, metavar="N",
                 help="sample with the whole DecoderLM tensor-parallel over N devices "
                      "(models.shard), then score as --train-fsdp says; only this section "
                      "runs (None: 1 when --train-fsdp is given)")
  p.add_argument("--train-fsdp", type=positive_int, default=None, metavar="M",
                 help="score the samples with the DecoderLM fully sharded over M devices "
                      "and unsharded (None: 1 when --rollout-tp is given)")
  p.add_argument("--model-fn", type=_model_fn_spec, default=None, metavar="MODULE:FUNCTION",
                 help="check a user's model function (docs/transform.md, parity protocol) "
                      "under batch_invariant instead; only this section runs")


def needs_no_fma_flag(implementation: str | None) -> bool:
  """Whether jaxrl_kernels' path runs interpreted Pallas kernels on the CPU, whose bits
  need XLA's CPU code without FMA contraction (see ``jaxrl_kernels._backend``).

  Only ``"interpret"`` does; the CPU default, ``"cpu"``, is immune by construction and
  runs with the user's flags as they are.
  """
  return implementation == "interpret"


def select_device(device: str | None, tp: int = 1) -> None:
  """Picks the JAX platform before JAX starts its backends (no-op if they run already)."""
  if device is None:
    return
  if device == "cpu" and tp > 1 and "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={tp}").strip()
  jax.config.update("jax_platforms", device if device != "gpu" else "cuda")
  if jax.default_backend() != device:
    usage_error(f"--device {device}: JAX already runs on {jax.default_backend()!r}; set "
                f"JAX_PLATFORMS before starting Python")


def header(title: str) -> None:
  dev = jax.devices()[0]
  print(f"jaxrl_kernels {title}")
  print(f"  device       {dev.platform}: {getattr(dev, 'device_kind', dev)}")
  print(f"  jax          {jax.__version__}")


def run_kernels(args) -> int:
  select_device(args.device)
  header("batch-invariance report")
  return 0 if kernels_report(args) else 1


def run_model_fn(args) -> int:
  """``parity --model-fn module:function``: the user's model under ``batch_invariant``."""
  try:
    from jaxrl_kernels.cli import model_fn
  except ImportError as e:
    usage_error(f"--model-fn needs jaxrl_kernels.cli.model_fn, which this "
                f"installation cannot import: {e}")
  select_device(args.device)
  try:  # the user's module, its function and what it returns, checked before any work
    model_fn.load(args.model_fn, seed=args.seed)
  except (ImportError, AttributeError, TypeError, ValueError) as e:
    usage_error(f"--model-fn {args.model_fn}: {e}")
  header("on-policy parity report")
  t0 = time.perf_counter()
  with Progress(5) as bar:
    ok = model_fn.parity_report(args.model_fn, implementation=args.implementation,
                                seed=args.seed, batch=args.batch, prompt_len=args.prompt_len,
                                new_tokens=args.new_tokens, progress=bar.stage)
    bar.finish()
  print(f"({time.perf_counter() - t0:.1f}s)")
  return 0 if ok else 1


def run_sharded(args) -> int:
  """``parity --rollout-tp N --train-fsdp M`` (or ``--model PRESET|hf:PATH``): the
  DecoderLM sampled TP = N, scored FSDP = M and unsharded (:mod:`jaxrl_kernels.cli.parity_tp`)."""
  from jaxrl_kernels.cli import parity_tp

  n, m = args.rollout_tp or 1, args.train_fsdp or 1
  for flag, bad in (("--tp", args.tp > 1), ("--params", args.params is not None),
                    ("--vocab-size", args.vocab_size is not None)):
    if bad:
      usage_error(f"{flag} belongs to the TinyCausalLM check; the sharded DecoderLM check "
                  f"(--rollout-tp / --train-fsdp / --model {args.model}) does not take it")
  try:
    cfg = parity_tp.model_config(args.model, args.layers)
  except INPUT_ERRORS as e:
    usage_error(f"--model {args.model}: {e}")
  select_device(args.device, max(n, m))
  problem = parity_tp.check_layout(cfg, rollout_tp=n, train_fsdp=m,
                                   num_devices=len(jax.devices()))
  if problem:
    usage_error(problem)
  build = dict(dtype=args.model_dtype, seed=args.seed, layers=args.layers)
  try:  # a checkpoint or a dtype the library refuses stops here, before any report
    model = parity_tp.build_model(args.model, implementation=args.implementation, **build)
    stock = parity_tp.build_model(args.model, implementation="xla", **build)
  except INPUT_ERRORS as e:
    usage_error(f"--model {args.model} --model-dtype {args.model_dtype}: {e}")
  header("on-policy parity report")
  t0 = time.perf_counter()
  # Stages: the build, then per sampler (ours at TP = N and unsharded, the psum control at
  # N > 1, stock XLA) one rollout and two trainers.
  stages = 3 * (2 + (n > 1) + 1) + 1
  with Progress(stages) as bar:
    bar.stage(f"build {args.model} (kernels and stock XLA)")
    ok = parity_tp.tp_report(model, rollout_tp=n, train_fsdp=m, stock_model=stock,
                             seed=args.seed, batch=args.batch, prompt_len=args.prompt_len,
                             new_tokens=args.new_tokens, temperature=args.temperature,
                             progress=bar.stage, label=args.model)
    bar.finish()
  print(f"({time.perf_counter() - t0:.1f}s)")
  return 0 if ok else 1


def run_parity(args) -> int:
  for name in ("batch", "prompt_len", "new_tokens", "tp"):
    if getattr(args, name) < 1:
      usage_error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.vocab_size is not None and args.vocab_size < 2:
    usage_error(f"--vocab-size must be >= 2, got {args.vocab_size}")
  if args.layers is not None and args.model not in PRESETS:
    usage_error(f"--layers sets the depth of a models preset ({', '.join(sorted(PRESETS))}), "
                f"not of --model {args.model}")
  if args.model_fn is not None:
    if args.rollout_tp or args.train_fsdp:
      usage_error("--model-fn checks a user's model function; it does not take "
                  "--rollout-tp / --train-fsdp")
    return run_model_fn(args)
  if args.rollout_tp or args.train_fsdp or args.model not in TINY_LM_PRESETS:
    return run_sharded(args)
  from jaxrl_kernels.nn.tiny_lm import TinyLMConfig
  if args.params is not None and not os.path.exists(args.params):
    usage_error(f"--params {args.params}: no such file or folder")
  # Everything that can refuse the arguments runs before the first kernel compiles.
  vocab = model_vocab_size(TinyLMConfig.preset(args.model).vocab_size, args.vocab_size, args.tp)
  try:
    cfg = TinyLMConfig.preset(args.model, dtype=plain_dtype("--model-dtype", args.model_dtype,
                                                            "float32"), vocab_size=vocab)
  except INPUT_ERRORS as e:
    usage_error(f"--model-dtype {args.model_dtype}: {e}")
  select_device(args.device, args.tp)
  mesh = tp_mesh(args.tp, args.device)
  if args.params is not None:
    check_params(cfg, args.params)
  header("on-policy parity report")
  t0 = time.perf_counter()
  ok = kernels_report(args)
  ok &= parity_report(args, mesh)
  print(f"({time.perf_counter() - t0:.1f}s)")
  return 0 if ok else 1
