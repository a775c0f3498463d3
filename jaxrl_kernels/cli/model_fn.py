"""A user's model function for ``jaxrl-kernels parity --model-fn module:function``.

The protocol (docs/transform.md, "Parity protocol"): ``module:function`` names
``build(seed: int) -> (params, model)`` where ``model`` has three functions of
plain arrays:

* ``model.forward(params, tokens[B, T]) -> logits[B, T, V]`` (the training forward);
* ``model.init_cache(params, batch: int, max_len: int) -> cache`` (any pytree);
* ``model.decode(params, cache, token[B], position) -> (logits[B, V], cache)``:
  the sampler's step, ``token`` at the int32 scalar ``position`` of every row.

:func:`parity_report` samples with ``decode`` and scores the samples with
``forward``, for the model as written and under :func:`batch_invariant`.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels.diagnostics import logprob_drift
from jaxrl_kernels.transform.api import batch_invariant

_METHODS = ("forward", "init_cache", "decode")


def load(spec: str, *, seed: int = 0) -> tuple[Any, Any]:
  """Imports ``module:function``, calls it with ``seed`` and checks the protocol.

  Returns ``(params, model)``. Raises ``ValueError`` for a malformed ``spec``,
  ``ImportError`` for a module that cannot be imported, ``AttributeError`` for a
  missing function, ``TypeError`` for a result that is not ``(params, model)`` or a
  model without callable ``forward``, ``init_cache`` and ``decode``.
  """
  if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
    raise ValueError(f"model_fn: spec must be 'module:function', got {spec!r}")
  module_name, fn_name = spec.split(":")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ImportError(f"model_fn: cannot import module {module_name!r} of {spec!r}: {e}") from e
  build = getattr(module, fn_name, None)
  if build is None:
    raise AttributeError(f"model_fn: module {module_name!r} has no attribute {fn_name!r}")
  if not callable(build):
    raise TypeError(f"model_fn: {spec} must be a function build(seed) -> (params, model), got "
                    f"{type(build).__name__}")
  out = build(seed)
  if not isinstance(out, tuple) or len(out) != 2:
    got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
    raise TypeError(f"model_fn: {spec}(seed) must return (params, model), got {got}")
  params, model = out
  missing = [m for m in _METHODS if not callable(getattr(model, m, None))]
  if missing:
    raise TypeError(f"model_fn: the model returned by {spec} must have callable "
                    f"{', '.join(_METHODS)}; missing {', '.join(missing)}")
  return params, model


def _token_logp(logits, tokens):
  """``log_softmax(logits)[token]`` in float32; run under ``batch_invariant``, so a
  row's bits do not depend on the array's shape (sampler ``[B, V]``, trainer
  ``[B, T, V]``)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def _sample(model, params, prompts, new_tokens: int, key, token_logp: Callable):
  """Feeds ``prompts [B, P]`` one token at a time, then samples ``new_tokens`` tokens
  (categorical at temperature 1, ``fold_in(key, position)``); returns the ``[B, P +
  new_tokens]`` tokens and the sampler's log-probs ``[B, new_tokens]`` of the sampled ones."""
  b, p = prompts.shape
  total = p + new_tokens
  decode = jax.jit(model.decode)
  cache = model.init_cache(params, b, total)
  toks = np.zeros((b, total), np.int32)
  toks[:, :p] = prompts
  logps = []
  for i in range(total - 1):
    logits, cache = decode(params, cache, jnp.asarray(toks[:, i]), jnp.int32(i))
    if i + 1 >= p:
      nxt = jax.random.categorical(jax.random.fold_in(key, i), logits.astype(jnp.float32))
      toks[:, i + 1] = np.asarray(nxt, np.int32)
      logps.append(np.asarray(token_logp(logits, jnp.asarray(toks[:, i + 1]))))
  return toks, np.stack(logps, axis=1)


def _score(model, params, toks, prompt_len: int, token_logp: Callable):
  """The trainer's log-probs of the sampled tokens: ``forward`` over every row of
  ``toks`` plus one extra random row (another batch size, other rows' content)."""
  extra = np.random.default_rng(0).permutation(toks[0])[None]
  batch = np.concatenate([toks, extra])
  logits = jax.jit(model.forward)(params, jnp.asarray(batch[:, :-1]))
  logp = np.asarray(token_logp(logits, jnp.asarray(batch[:, 1:])))
  return logp[:toks.shape[0], prompt_len - 1:]


def parity_report(spec: str, *, implementation: str | None = None, seed: int = 0,
                  batch: int = 4, prompt_len: int = 8, new_tokens: int = 8,
                  progress: Callable[[str], Any] | None = None) -> bool:
  """Prints the sampler/trainer drift of a user's model; True iff it is bitwise under
  :func:`batch_invariant`.

  For the model as written and for ``batch_invariant(model.forward)`` /
  ``batch_invariant(model.decode)``: samples ``new_tokens`` tokens after random
  ``prompt_len``-token prompts for ``batch`` rows with ``decode`` against a cache of
  ``prompt_len + new_tokens`` slots, then scores the sequences with ``forward`` at
  batch ``batch + 1`` (an extra row), and compares the log-probs of the sampled
  tokens (:func:`jaxrl_kernels.logprob_drift`). Log-probs are taken from the
  logits by one ``batch_invariant`` log-softmax on both sides.

  Args:
    spec: ``"module:function"`` (:func:`load`).
    implementation: the kernels' implementation for ``batch_invariant``.
    seed: passed to ``build`` and seeds the prompts and the sampling.
    batch, prompt_len, new_tokens: positive sizes.
    progress: called with a description at the start of each stage (for a progress bar).

  Returns:
    True iff every sampled token's log-prob from the transformed trainer equals the
    transformed sampler's bitwise.
  """
  for name, v in (("batch", batch), ("prompt_len", prompt_len), ("new_tokens", new_tokens)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"model_fn.parity_report: {name} must be a positive int, got {v!r}")
  stage = progress if progress is not None else (lambda _: None)
  stage("model function: build")
  params, model = load(spec, seed=seed)
  vocab = jax.eval_shape(model.forward, params, jnp.zeros((1, 1), jnp.int32)).shape[-1]
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, vocab, (batch, prompt_len)).astype(np.int32)
  token_logp = jax.jit(batch_invariant(_token_logp, implementation=implementation))

  transformed = types.SimpleNamespace(
      forward=batch_invariant(model.forward, implementation=implementation),
      decode=batch_invariant(model.decode, implementation=implementation),
      init_cache=model.init_cache)
  reports = {}
  for label, m in (("as written", model), ("batch_invariant", transformed)):
    stage(f"{label}: sample (decode, batch {batch})")
    toks, ref = _sample(m, params, prompts, new_tokens, jax.random.key(seed), token_logp)
    stage(f"{label}: score (forward, batch {batch + 1})")
    cand = _score(m, params, toks, prompt_len, token_logp)
    reports[label] = logprob_drift(cand, ref, toks[:, prompt_len:])
  print(f"\n== on-policy parity of {spec}: decode sampler (batch {batch}) vs forward trainer "
        f"(batch {batch + 1})")
  print(f"data   {batch} prompts of {prompt_len} tokens, {new_tokens} sampled tokens each, "
        f"V={vocab}, seed {seed}, implementation={implementation}")
  for label, r in reports.items():
    print(f"\n-- {label}: trainer vs sampler log-probs of the {r.num_active} sampled tokens")
    print(r.table())
  ok = reports["batch_invariant"].bitwise_equal
  print(f"\nparity: batch_invariant({spec}) is " +
        ("bitwise on-policy (trainer log-probs == sampler log-probs, every token)" if ok
         else "NOT bitwise on-policy here"))
  return ok
