"""A KV-cache sampler for any causal LM with the cache protocol, and the trainer-side scorer.

``sample`` decodes one token per row per step on the KV cache at the rollout
batch size and reports, for every sampled token, the log-prob the model's
fused LM head (``linear_logp``) gives it. ``score`` recomputes the same
log-probs the way a trainer does: one full-sequence forward over the
finished sequences, at another batch size, in chunks, optionally packed
several sequences per row, optionally with the head vocab-parallel over a
mesh. With the batch-invariant kernels (``implementation=None``) the two
agree bit for bit; ``jaxrl-kernels parity`` prints how far they are apart.

Both work on any model with the :class:`CausalLM` protocol:
:class:`~jaxrl_kernels.nn.TinyCausalLM`,
:class:`~jaxrl_kernels.models.DecoderLM` (Llama / Qwen2 / Qwen3), and
:class:`~jaxrl_kernels.models.ShardedDecoderLM` (the same model sharded over a
mesh by ``models.shard``: sampling at TP = N and scoring under FSDP give the
unsharded bits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxrl_kernels import _validation, contract
from jaxrl_kernels.nn.lm_head import LMHead, LogitPartials, logp_from_stats
from jaxrl_kernels.nn.protocol import CausalLM as CausalLM
from jaxrl_kernels.pallas import draw as race
from jaxrl_kernels.pallas import softmax_partials as sp


class SampleResult(NamedTuple):
  """What :func:`sample` returns (``N = max_new_tokens``).

  Attributes:
    tokens: ``[B, P + N]`` int32: row ``b`` is its prompt (``prompt_lengths[b]``
      tokens), then its completion, then 0s.
    lengths: ``[B]`` int32, prompt + completion length.
    completion_mask: ``[B, P + N]`` bool, True on sampled tokens.
    logp: ``[B, P + N]`` float32, the sampler's log-prob of each sampled token
      at ``temperature`` (the head's ``linear_logp`` of the hidden state that
      produced it, over the whole vocabulary: top-k / top-p change which token
      is drawn, not this value), 0 elsewhere.
  """

  tokens: jax.Array
  lengths: jax.Array
  completion_mask: jax.Array
  logp: jax.Array


def fixed_order_cumsum(x: jax.Array) -> jax.Array:
  """``[..., n]`` -> ``[..., n]`` inclusive prefix sums over the last axis, as a written-out
  scan tree (``lax.associative_scan``: slices and elementwise adds, one order for
  every shape; ``jnp.cumsum`` leaves the order to XLA)."""
  return lax.associative_scan(jnp.add, x, axis=x.ndim - 1)


def draw(key: jax.Array, logits: jax.Array, *, top_k: int | None = None,
         top_p: float | None = None) -> jax.Array:
  """One int32 token id per row of ``logits [B, V]`` (already divided by the temperature).

  No truncation: ``categorical(key, logits)``. ``top_k``: the ``k`` largest logits
  (``lax.top_k``, ties to the lower id). ``top_p``: of those (or of all, sorted by
  descending logit, ties to the lower id), the shortest prefix whose probability
  mass (renormalised over the candidates, fixed-order sums) reaches ``top_p``;
  the first candidate is always kept. Then ``categorical`` over the kept ones.
  """
  if top_k is None and top_p is None:
    return jax.random.categorical(key, logits).astype(jnp.int32)
  if top_k is not None:
    vals, ids = lax.top_k(logits, top_k)
  else:
    iota = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    neg, ids = lax.sort((-logits, iota), dimension=logits.ndim - 1, num_keys=2)
    vals = -neg
  if top_p is not None:
    e = jnp.exp(vals - vals[..., :1])
    cum = fixed_order_cumsum(e)
    keep = (cum - e) < jnp.float32(top_p) * cum[..., -1:]
    vals = jnp.where(keep, vals, -jnp.inf)
  choice = jax.random.categorical(key, vals)
  return jnp.take_along_axis(ids, choice[..., None], axis=-1)[..., 0].astype(jnp.int32)


CACHE_ALIGN = 64  # cache slots per row: a multiple of this (every attention key tile)


def cache_length(total: int) -> int:
  """The sampler's cache slots per row for ``total`` positions (prompt + new tokens)."""
  return -(-total // CACHE_ALIGN) * CACHE_ALIGN


# Decode steps per chunk of the sampler loop: the loop's condition (a device-to-host read)
# runs once per chunk, and the chunk's LM-head statistics are merged in one launch.
SAMPLER_CHUNK = 32


def _generate(model: CausalLM, prompts, prompt_lengths, key, *, max_new_tokens: int,
              temperature: float, stop_ids: tuple[int, ...], top_k: int | None,
              top_p: float | None, steps_per_chunk: int = SAMPLER_CHUNK,
              fused_draw: bool = True, num_samples: int = 1,
              prefill_chunk: int | None = None, stop_table=None):
  b, p = prompts.shape
  n = max_new_tokens
  total = p + n
  # The cache rounded up to whole key tiles: a key length the Mosaic attention's TMA does
  # not take would be padded (copied) per layer per step. Slots past a row's length are
  # never read, so the bits are those of any other cache length.
  cache = model.init_cache(b, cache_length(total))
  if prefill_chunk is None:
    h, cache = model.prefill(prompts, prompt_lengths, cache)
  else:
    h, cache = model.prefill(prompts, prompt_lengths, cache, chunk=prefill_chunk)
  if num_samples > 1:
    # Each prompt prefilled once, its hidden state and cache rows repeated for its
    # num_samples completions: prefill rows are batch-invariant, so these are the bits of
    # prefilling every repeated row.
    g = num_samples
    h = jnp.repeat(h, g, axis=0)
    cache = jax.tree.map(lambda x: jnp.repeat(x, g, axis=0), cache)
    prompts = jnp.repeat(prompts, g, axis=0)
    prompt_lengths = jnp.repeat(prompt_lengths, g, axis=0)
    if stop_table is not None:
      stop_table = jnp.repeat(stop_table, g, axis=0)
    b = b * g
  rows = jnp.arange(b)
  cols = jnp.arange(total)
  tokens = jnp.where(cols < prompt_lengths[:, None], jnp.pad(prompts, ((0, 0), (0, n))), 0)
  state = (tokens, jnp.zeros((b, total), bool), jnp.zeros((b, total), jnp.float32),
           jnp.zeros((b,), bool))
  stops = jnp.asarray(stop_ids, jnp.int32)
  head = model.head
  v = model.config.vocab_size
  # Kernel heads give the logits' per-tile statistics unmerged: the merge (a sequential fold
  # over the vocabulary tiles, whose latency does not shrink with fewer rows) runs once per
  # chunk of steps on all of the chunk's rows. Each row's merge is the same fold, so the
  # log-probs are bitwise those of a per-step merge. Other heads (the stock path, a
  # vocab-parallel head) report each step's log-prob at once.
  deferred = hasattr(head, "logits_partials") and getattr(head, "implementation", None) != "xla"
  # The draw in the head's own pass (no top-k / top-p: those need the sorted logits).
  fused = (deferred and fused_draw and top_k is None and top_p is None
           and hasattr(head, "draw_partials"))
  k = max(1, min(n - 1, steps_per_chunk))
  if deferred:
    n_tiles = -(-v // contract.VOCAB_TILE)
    # Per slot of the chunk: the head's per-tile statistics, the target logit, the token.
    buf = (tuple(jnp.zeros((n_tiles, k, b), jnp.float32) for _ in range(3)),
           jnp.zeros((k, b), jnp.float32), jnp.zeros((k, b), jnp.int32))
  else:
    buf = ()

  def emit(h, state, buf, i, slot):
    """Samples token ``i`` of every row from ``h`` and records it (its log-prob, or what
    the chunk's merge needs for it, in ``slot`` of ``buf``)."""
    tokens, mask, logp, done = state
    if fused:
      # One head pass draws the token (the race of pallas.draw, keyed by the step's seed)
      # and gives its logit and the per-tile statistics; no logits in memory on Hopper.
      seed = race.seed_words(jax.random.fold_in(key, i))
      tok, tz, stats = head.draw_partials(h, seed, temperature=temperature)
    elif deferred:
      # One head pass: the logits and their per-tile statistics from the same kernel (the
      # fused op's own per-tile code), merged with the chunk in flush().
      logits, stats = head.logits_partials(h, temperature=temperature)
    else:
      # The logits and their merged statistics (stock path: a plain log-softmax).
      logits, stats = head.logits(h, temperature=temperature, return_stats=True)
    if not fused:
      tok = draw(jax.random.fold_in(key, i), logits, top_k=top_k, top_p=top_p)
    live = ~done
    at = prompt_lengths + i
    tokens = tokens.at[rows, at].set(jnp.where(live, tok, 0))
    mask = mask.at[rows, at].set(live)
    if deferred:
      parts, tz_buf, tok_buf = buf
      if not fused:
        tz = jnp.take_along_axis(logits, jnp.clip(tok, 0, v - 1)[:, None], axis=-1)[:, 0]
      buf = (tuple(x.at[:, slot].set(y) for x, y in zip(parts, stats, strict=True)),
             tz_buf.at[slot].set(tz), tok_buf.at[slot].set(tok))
    else:
      lp = logp_from_stats(logits, stats, tok)
      logp = logp.at[rows, at].set(jnp.where(live, lp, 0.0))
    if stop_ids:
      done = done | jnp.any(tok[:, None] == stops[None, :], axis=1)
    if stop_table is not None:
      done = done | _ends_with_stop(tokens, at, prompt_lengths, stop_table)
    return tok, (tokens, mask, logp, done), buf

  def flush(state, buf, i0, count: int):
    """Merges the statistics of steps ``i0 .. i0 + count - 1`` (slots ``0 .. count - 1``)
    and records their log-probs: ``logp_from_stats`` of each step, bitwise."""
    if not deferred:
      return state
    tokens, mask, logp, done = state
    parts, tz_buf, tok_buf = buf
    merged = head.merge_partials(LogitPartials(*(x[:, :count] for x in parts)))
    lp, _ = sp.finalize(tz_buf[:count], merged.lse, merged.entropy, tok_buf[:count], None, v)
    at = prompt_lengths[None, :] + i0 + jnp.arange(count)[:, None]
    live = mask[rows[None, :], at]
    logp = logp.at[rows[None, :], at].set(jnp.where(live, lp, 0.0))
    return tokens, mask, logp, done

  # Weights in the layout a decode step multiplies, made once here rather than in every
  # step (models that have them: DecoderLM's padded row-parallel chunks).
  weights = model.decode_weights() if hasattr(model, "decode_weights") else None

  def decode(j, carry):
    i0, h, cache, state, buf = carry
    tok, state, buf = emit(h, state, buf, i0 + j, j)
    h, cache = (model.decode_step(tok, cache) if weights is None
                else model.decode_step(tok, cache, weights=weights))
    return i0, h, cache, state, buf

  def chunk_cond(carry):
    i0, _, _, state, _ = carry
    return (i0 + k <= n - 1) & ~jnp.all(state[3])

  def chunk(carry):
    i0, h, cache, state, buf = lax.fori_loop(0, k, decode, carry)
    return i0 + k, h, cache, flush(state, buf, i0, k), buf

  # Whole chunks of k decode steps; the loop stops early once every row has hit a stop id
  # (at a chunk boundary: the rest of a chunk records nothing for finished rows).
  carry = lax.while_loop(chunk_cond, chunk, (jnp.int32(0), h, cache, state, buf))
  # The remaining decode steps (fewer than k; none after an early stop records anything),
  # then the last token, which needs no decode step.
  tail = (n - 1) % k if n > 1 else 0
  i0, h, _, state, buf = lax.fori_loop(0, tail, decode, carry)
  _, state, buf = emit(h, state, buf, i0 + tail, tail)
  tokens, mask, logp, _ = flush(state, buf, i0, tail + 1)
  lengths = prompt_lengths + jnp.sum(mask, axis=1, dtype=jnp.int32)
  return SampleResult(tokens, lengths, mask, logp)


def _ends_with_stop(tokens, at, prompt_lengths, table):
  """``[B]`` bool: row ``r``'s completion ends (at position ``at[r]``) with one of its stop
  sequences ``table[r]`` (``[S, L]``, each right-aligned, ``-1`` left padding; a slot of all
  ``-1`` is empty). Only completion positions match: a sequence never straddles the prompt.
  Only ``-1`` is padding: another negative entry (refused when the table is concrete)
  matches no token."""
  n_len = table.shape[-1]
  pos = at[:, None] - (n_len - 1) + jnp.arange(n_len)[None, :]  # [B, L]
  window = jnp.take_along_axis(tokens, jnp.clip(pos, 0, tokens.shape[1] - 1), axis=1)
  in_completion = pos >= prompt_lengths[:, None]
  pad = table == -1
  ok = pad | ((window[:, None, :] == table) & in_completion[:, None, :])
  return jnp.any(jnp.all(ok, axis=-1) & ~jnp.all(pad, axis=-1), axis=-1)


def _stop_table(stop_sequences, batch: int, vocab_size: int):
  """``stop_sequences`` as an int32 ``[B, S, L]`` table (right-aligned, ``-1`` padding), or
  None when there are none. Takes a sequence of id sequences (every row's), ``B`` such
  sequences (one per prompt), or an int array ``[S, L]`` / ``[B, S, L]`` already padded."""
  op, name = "sample", "stop_sequences"
  if stop_sequences is None:
    return None
  if isinstance(stop_sequences, jax.Array | np.ndarray):
    table = _validation.as_ids(op, name, stop_sequences)  # int dtype; wide ids never wrap
    if table.ndim not in (2, 3) or (table.ndim == 3 and table.shape[0] != batch) or (
        0 in table.shape[-2:]):
      raise ValueError(f"{op}: {name} as an array must be int [S, L] (every row's) or "
                       f"[B={batch}, S, L] (one table per prompt) with S, L >= 1, -1 "
                       f"padding on the left; got {table.dtype} {table.shape}")
    if _validation.is_concrete(table):
      t = np.asarray(table)
      # -1 after an id (right padding) would read as "any token" at the end of the sequence.
      late = (t[..., :-1] != -1) & (t[..., 1:] == -1)
      if late.any():
        idx = tuple(int(i) for i in np.argwhere(late)[0])
        raise ValueError(f"{op}: {name}: -1 pads on the left only (sequences are "
                         f"right-aligned); slot {idx[:-1]} has -1 after an id: "
                         f"{t[idx[:-1]].tolist()}")
    table = jnp.broadcast_to(table, (batch, *table.shape[-2:]))
    _validation.check_ids_in_range(op, name, table, vocab_size, table != -1)
    return table
  if isinstance(stop_sequences, str | bytes):
    raise ValueError(f"{op}: {name} holds token id sequences, got a string (text stop "
                     f"strings: text.generate_text(stop_strings=...))")
  seqs = list(stop_sequences)
  if not seqs:
    return None

  def is_seq(x):
    return isinstance(x, list | tuple | np.ndarray)

  # One list per prompt when some element holds sequences (a prompt's list may be empty);
  # B empty lists: no prompt has a sequence.
  if len(seqs) == batch and all(is_seq(r) and len(r) == 0 for r in seqs):
    return None
  nested = any(is_seq(r) and any(is_seq(q) for q in r) for r in seqs)
  per_row = [list(r) if is_seq(r) else [r] for r in seqs] if nested else None
  rows = per_row if per_row is not None else [seqs]
  if per_row is not None and len(per_row) != batch:
    raise ValueError(f"{op}: {name} given per prompt must hold {batch} lists (one per "
                     f"prompt), got {len(per_row)}")
  for r, row in enumerate(rows):
    for j, sq in enumerate(row):
      where = f"[{r}][{j}]" if per_row is not None else f"[{j}]"
      if not is_seq(sq) or len(sq) == 0 or not all(
          _is_int(t) and 0 <= t < vocab_size for t in sq):
        raise ValueError(f"{op}: {name}{where} must be a non-empty sequence of ints in "
                         f"[0, {vocab_size}), got {sq!r}")
  n_seq = max(len(row) for row in rows)
  if n_seq == 0:  # no prompt has a sequence
    return None
  n_len = max(len(sq) for row in rows for sq in row)
  table = np.full((len(rows), n_seq, n_len), -1, np.int32)
  for r, row in enumerate(rows):
    for j, sq in enumerate(row):
      table[r, j, n_len - len(sq):] = sq
  return jnp.asarray(np.broadcast_to(table, (batch, n_seq, n_len)))


_generate_jit = nnx.jit(_generate, static_argnames=("max_new_tokens", "temperature",
                                                    "stop_ids", "top_k", "top_p",
                                                    "steps_per_chunk", "fused_draw",
                                                    "num_samples", "prefill_chunk"))


def _is_int(x) -> bool:
  return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def sample(model: CausalLM, prompts: jax.Array, prompt_lengths: jax.Array, *,
           max_new_tokens: int, key: jax.Array, temperature: float = 1.0,
           eos_id: int | None = None, stop_ids: Sequence[int] = (),
           top_k: int | None = None, top_p: float | None = None,
           steps_per_chunk: int = SAMPLER_CHUNK, fused_draw: bool = True,
           num_samples: int = 1, prefill_chunk: int | None = None,
           stop_sequences: Sequence[Sequence[int]] | Sequence[Sequence[Sequence[int]]]
           | jax.Array | np.ndarray | None = None) -> SampleResult:
  """Samples up to ``max_new_tokens`` tokens per prompt with the KV cache, in one jitted call.

  Prefills the prompts, then per step: a token drawn with ``fold_in(key, step)`` and the
  logits' statistics from one head pass (``model.head.draw_partials``, the draw in the
  head's own kernel, see ``fused_draw``; or ``model.head.logits_partials`` and a draw from
  the logits, optionally restricted to the top-k / top-p candidates; the per-tile
  statistics merged once per chunk of ``steps_per_chunk`` steps; or
  ``model.head.logits(h, T, return_stats=True)`` for heads without partials), its log-prob
  (bitwise ``model.head(h, token, temperature=T)`` on the kernel paths: the trainer's
  ``model.logp``), then ``model.decode_step``. Rows that sampled a stop id or completed a
  stop sequence stop; the loop ends early (at a chunk boundary) when every row has. A
  finished row keeps its slot until then (static shapes: one compiled program), its
  decode work spent and nothing recorded.

  Args:
    model: a :class:`CausalLM` (``TinyCausalLM``, ``models.DecoderLM``).
    prompts: ``[B, P]`` int, right-padded.
    prompt_lengths: ``[B]`` int in ``[1, P]``.
    max_new_tokens: static ``N >= 1``; the cache holds ``P + N`` positions (rounded up to
      a multiple of :data:`CACHE_ALIGN`).
    key: a PRNG key. The same key, model and inputs give the same tokens.
    temperature: static float > 0.
    eos_id: optional stop id (kept for compatibility; joins ``stop_ids``).
    stop_ids: ids after which a row stops (the stop token is part of the
      completion; later positions are 0, masked, with logp 0).
    top_k: static int in ``[1, V]`` or None: draw among the ``k`` largest logits.
    top_p: static float in ``(0, 1]`` or None: draw from the smallest set of top
      candidates whose renormalised probability reaches ``top_p`` (after
      ``top_k``). The reported ``logp`` stays the full softmax's (the trainer's).
    steps_per_chunk: static int >= 1: decode steps per iteration of the sampling loop
      (its condition is read by the host once per chunk) and, with a kernel head, per
      merge of the LM-head statistics (one launch for the chunk's rows). Changes no bit;
      after every row has stopped, at most ``2 (steps_per_chunk - 1)`` steps still run.
    fused_draw: static bool. With a kernel head and neither ``top_k`` nor ``top_p``, True
      draws each token in the head's own pass (``head.draw_partials``: the exponential race
      of :mod:`jaxrl_kernels.pallas.draw`, its noise a counter-based hash of the step's
      ``fold_in(key, step)``, the row and the column; on Hopper no ``[B, V]`` logits reach
      memory). False draws with ``jax.random.categorical`` from stored logits. Either
      is a draw from the same softmax, with other tokens for the same key; the reported
      log-probs are the trainer's bits either way.
    num_samples: static int ``G >= 1``: completions per prompt (a GRPO group). Each prompt
      is prefilled once, its hidden state and cache rows repeated for its ``G`` rows (the
      prefill's work once, the cache held ``G`` times); the result has ``B G`` rows,
      prompt-major (rows ``[i G, (i + 1) G)`` are prompt ``i``'s, the layout of
      ``rl.group_advantages(rewards, G)``), bitwise the result of sampling
      ``jnp.repeat(prompts, G, 0)`` with the same key.
    prefill_chunk: static int ``C >= 1`` or None: prefill the prompts ``C`` positions at a
      time (``model.prefill(..., chunk=C)``, models that take it: ``DecoderLM``); the same
      cache and hidden states bitwise, so the same tokens and log-probs.
    stop_sequences: token id sequences after which a row stops (the sequence is part of
      the completion), matched on the completion's tokens only (never across the prompt):
      a list of id lists for every row, ``B`` such lists (one per prompt, shared by its
      ``num_samples`` rows), or an int array ``[S, L]`` / ``[B, S, L]`` with each sequence
      right-aligned and ``-1`` on its left (an all ``-1`` slot is empty). The array is an
      operand, not a static argument: other sequences of the same shape compile nothing.
      A one-token sequence per row is a per-row stop id. Stopping only masks what follows:
      the kept tokens and log-probs are bitwise those of the same call without it.

  Returns:
    A :class:`SampleResult` (``B G`` rows).
  """
  v = model.config.vocab_size
  prompts = _validation.as_ids("sample", "prompts", prompts)
  prompt_lengths = _validation.as_ids("sample", "prompt_lengths", prompt_lengths)
  if prompts.ndim != 2 or prompt_lengths.shape != prompts.shape[:1]:
    raise ValueError(f"sample: prompts must be [B, P] and prompt_lengths [B], got "
                     f"{prompts.shape} and {prompt_lengths.shape}")
  if not _is_int(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"sample: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  temperature = _validation.as_temperature("sample", temperature)
  if isinstance(temperature, jax.Array):
    raise TypeError("sample: temperature must be a concrete number (it is static), got a "
                    "traced value")
  if prompts.shape[1] == 0:
    raise ValueError(f"sample: prompts must have at least one column, got shape "
                     f"{prompts.shape}")
  if _validation.is_concrete(prompt_lengths):
    pl = np.asarray(prompt_lengths)
    if not np.all((pl >= 1) & (pl <= prompts.shape[1])):
      raise ValueError(f"sample: prompt_lengths must lie in [1, {prompts.shape[1]}], got "
                       f"{pl.tolist()}")
  # Ids before prompt_lengths must lie in [0, V); the padding after them is inert.
  active = jnp.arange(prompts.shape[1], dtype=jnp.int32)[None, :] < prompt_lengths[:, None]
  _validation.check_ids_in_range("sample", "prompts", prompts, v, active)
  prompts = jnp.where(active, prompts, 0)
  ids = ([] if eos_id is None else [eos_id]) + list(stop_ids)
  for s in ids:
    if not _is_int(s) or not 0 <= s < v:
      name = "eos_id" if eos_id is not None and s is eos_id else "stop_ids"
      raise ValueError(f"sample: {name} must hold ints in [0, {v}), got {s!r}")
  if top_k is not None and (not _is_int(top_k) or not 1 <= top_k <= v):
    raise ValueError(f"sample: top_k must be None or an int in [1, {v}], got {top_k!r}")
  if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, int | float)
                            or not 0 < top_p <= 1):
    raise ValueError(f"sample: top_p must be None or a float in (0, 1], got {top_p!r}")
  if not _is_int(steps_per_chunk) or steps_per_chunk < 1:
    raise ValueError(f"sample: steps_per_chunk must be an int >= 1, got {steps_per_chunk!r}")
  if not isinstance(fused_draw, bool | np.bool_):
    raise ValueError(f"sample: fused_draw must be a bool, got {fused_draw!r}")
  if not _is_int(num_samples) or num_samples < 1:
    raise ValueError(f"sample: num_samples must be an int >= 1, got {num_samples!r}")
  if prefill_chunk is not None and (not _is_int(prefill_chunk) or prefill_chunk < 1):
    raise ValueError(f"sample: prefill_chunk must be None or an int >= 1, got "
                     f"{prefill_chunk!r}")
  stop_table = _stop_table(stop_sequences, prompts.shape[0], v)
  if prompts.shape[0] == 0:
    total = prompts.shape[1] + int(max_new_tokens)
    return SampleResult(jnp.zeros((0, total), jnp.int32), jnp.zeros((0,), jnp.int32),
                        jnp.zeros((0, total), bool), jnp.zeros((0, total), jnp.float32))
  return _generate_jit(model, prompts, prompt_lengths, key, max_new_tokens=int(max_new_tokens),
                       temperature=float(temperature),
                       stop_ids=tuple(sorted({int(s) for s in ids})),
                       top_k=None if top_k is None else int(top_k),
                       # top_p = 1 keeps every token: no truncation (as in transformers).
                       top_p=None if top_p is None or top_p == 1 else float(top_p),
                       steps_per_chunk=int(steps_per_chunk), fused_draw=bool(fused_draw),
                       num_samples=int(num_samples),
                       prefill_chunk=None if prefill_chunk is None else int(prefill_chunk),
                       stop_table=stop_table)


# --------------------------------------------------------------------------------- scoring


def _stock_tp_logp(h, w, targets, mask, *, axis_name, vocab_size, temperature):
  """The usual vocab-parallel log-softmax in plain XLA (Megatron style): local logits,
  ``pmax`` of the max, ``psum`` of the exp-sums and of the owned target logit."""
  v_s = w.shape[0]
  lo = lax.axis_index(axis_name) * v_s
  z = jnp.dot(h.astype(jnp.float32), w.astype(jnp.float32).T) / jnp.float32(temperature)
  z = jnp.where(lo + jnp.arange(v_s) < vocab_size, z, -jnp.inf)
  m = lax.pmax(jnp.max(z, axis=-1), axis_name)
  lse = m + jnp.log(lax.psum(jnp.sum(jnp.exp(z - m[:, None]), axis=-1), axis_name))
  local = targets - lo
  owned = (local >= 0) & (local < v_s)
  tz = jnp.take_along_axis(z, jnp.clip(local, 0, v_s - 1)[:, None], axis=-1)[:, 0]
  tz = lax.psum(jnp.where(owned, tz, 0.0), axis_name)
  return jnp.where(mask, tz - lse, 0.0)


def _tp_head(model: CausalLM, h, targets, mask, mesh: Mesh, temperature: float):
  """The head's log-probs with the vocabulary split over ``mesh``'s (only) axis."""
  from jaxrl_kernels import _compat
  from jaxrl_kernels.linear_logp import pad_vocab, vocab_parallel_logp

  head = model.head
  if head.weight_layout != "vh" or head.bias is not None:
    raise ValueError("score: tp_mesh supports a tied, bias-free head (weight_layout='vh')")
  (axis,) = mesh.axis_names
  tp = mesh.shape[axis]
  v = model.config.vocab_size
  w = pad_vocab(head.weight(), tp, weight_layout="vh")
  lead = targets.shape
  h2 = head.hidden(h).reshape(-1, h.shape[-1])
  t2, m2 = targets.reshape(-1), mask.reshape(-1)
  if head.implementation == "xla":
    fn = _compat.shard_map(
        lambda a, b, c, d: _stock_tp_logp(a, b, c, d, axis_name=axis, vocab_size=v,
                                          temperature=temperature),
        mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(axis, None), PartitionSpec(),
                             PartitionSpec()),
        out_specs=PartitionSpec(), check_vma=False)
    return fn(h2, w, t2, m2).reshape(lead)
  out = vocab_parallel_logp(h2, w, t2, mesh=mesh, weight_spec=PartitionSpec(axis, None),
                            vocab_size=v, mask=m2, temperature=temperature,
                            weight_layout="vh", fp32_head=head.fp32_head,
                            implementation=head.implementation)
  return out.reshape(lead)


def _rows_logp(model: CausalLM, tokens, targets, mask, positions, segment_ids, *,
               temperature: float, max_docs: int | None, tp_mesh: Mesh | None):
  if tp_mesh is None:
    return model.logp(tokens, targets, mask, positions=positions, segment_ids=segment_ids,
                      max_docs=max_docs, temperature=temperature)
  h = model(tokens, positions, segment_ids, max_docs=max_docs)
  return _tp_head(model, h, targets, mask, tp_mesh, temperature)


_rows_logp_jit = nnx.jit(_rows_logp, static_argnames=("temperature", "max_docs", "tp_mesh"))


def _pack(lengths: np.ndarray, width: int) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
  """First-fit packing of sequences (in order) into rows of ``width`` tokens.
  Returns each row's sequence ids and each sequence's (row, column)."""
  rows, room = [], []
  where_row = np.zeros(len(lengths), np.int64)
  where_col = np.zeros(len(lengths), np.int64)
  for b, n in enumerate(lengths):
    r = next((i for i, free in enumerate(room) if free >= n), None)
    if r is None:
      rows.append([])
      room.append(width)
      r = len(rows) - 1
    where_row[b], where_col[b] = r, width - room[r]
    rows[r].append(b)
    room[r] -= n
  return rows, where_row, where_col


def score(model: CausalLM, tokens, completion_mask, *, temperature: float = 1.0,
          batch_size: int | None = None, pack: bool = False,
          tp_mesh: Mesh | None = None) -> jax.Array:
  """The trainer's float32 log-probs of the completion tokens, from the full-sequence forward.

  ``out[b, t] = log p(tokens[b, t] | tokens[b, :t])`` at ``temperature`` where
  ``completion_mask[b, t]``, else 0: aligned with :class:`SampleResult` ``.logp``.
  Row ``b``'s sequence is ``tokens[b, :L_b]``, ``L_b`` = 1 + the last True
  column of its mask (the completion ends the sequence; a row with no
  completion is not scored).

  Args:
    model: a :class:`CausalLM`.
    tokens: ``[B, T]`` int (e.g. ``SampleResult.tokens``).
    completion_mask: ``[B, T]`` bool, False in column 0.
    temperature: static float > 0.
    batch_size: rows per forward call (default: all rows in one call); the last
      chunk is padded with empty rows.
    pack: first-fit pack the sequences into rows of ``2 T`` tokens, several
      per row (``segment_ids`` and positions restarting per sequence, unused
      tail positions -1), before chunking.
    tp_mesh: a 1-axis mesh: the LM head runs vocab-parallel over it
      (``vocab_parallel_logp``; for ``implementation="xla"`` models the usual
      ``pmax``/``psum`` log-softmax).

  Token ids of each row's sequence (columns before ``L_b``) must lie in ``[0, V)`` (a
  ValueError names the first bad one); columns at or past ``L_b`` are padding, inert
  whatever they hold. ``B = 0`` gives a ``[0, T]`` result.

  Returns:
    ``[B, T]`` float32 ``jax.Array``. The packing is decided on the host (it depends on
    the data); the forward runs under ``nnx.jit``.
  """
  temperature = _validation.as_temperature("score", temperature)
  if isinstance(temperature, jax.Array):
    raise TypeError("score: temperature must be a concrete number (it is static), got a "
                    "traced value")
  tokens = np.asarray(_validation.as_ids("score", "tokens", tokens))
  cm = np.asarray(_validation.as_mask("score", "completion_mask", completion_mask, None))
  if tokens.ndim != 2 or cm.shape != tokens.shape:
    raise ValueError(f"score: tokens and completion_mask must be [B, T] of one shape, got "
                     f"{tokens.shape} and {cm.shape}")
  if cm[:, :1].any():
    raise ValueError("score: completion_mask[:, 0] must be False (a first token has no prefix)")
  b, t = tokens.shape
  if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
    raise ValueError(f"score: batch_size must be an int >= 1 or None, got {batch_size!r}")
  if tp_mesh is not None and not isinstance(model.head, LMHead):
    raise ValueError(f"score: tp_mesh takes a model with an LMHead; this model's head is a "
                     f"{type(model.head).__name__} (a sharded model runs its own head "
                     f"vocab-parallel: pass tp_mesh=None)")
  if b == 0:
    return jnp.zeros((0, t), jnp.float32)
  lengths = np.where(cm.any(1), t - np.argmax(cm[:, ::-1], axis=1), 0)
  # The sequences' ids must lie in [0, V); what follows them is padding, set to 0.
  in_seq = np.arange(t)[None, :] < lengths[:, None]
  _validation.check_ids_in_range("score", "tokens", tokens, model.config.vocab_size, in_seq)
  tokens = np.where(in_seq, tokens, 0).astype(np.int32)
  # Column j predicts token j + 1.
  targets = np.zeros_like(tokens)
  targets[:, :-1] = tokens[:, 1:]
  tmask = np.zeros_like(cm)
  tmask[:, :-1] = cm[:, 1:]
  if pack:
    width = 2 * t
    rows, at_row, at_col = _pack(lengths, width)
    n_rows = len(rows)
    arrays = {k: np.zeros((n_rows, width), dt) for k, dt in
              (("tokens", np.int32), ("targets", np.int32), ("mask", bool),
               ("segment_ids", np.int32))}
    arrays["positions"] = np.full((n_rows, width), -1, np.int32)
    for s in range(b):
      r, c, n = at_row[s], at_col[s], lengths[s]
      arrays["tokens"][r, c:c + n] = tokens[s, :n]
      arrays["targets"][r, c:c + n] = targets[s, :n]
      arrays["mask"][r, c:c + n] = tmask[s, :n]
      arrays["positions"][r, c:c + n] = np.arange(n)
      arrays["segment_ids"][r, c:c + n] = 1 + rows[r].index(s)
  else:
    n_rows, width = b, t
    at_row, at_col = np.arange(b), np.zeros(b, np.int64)
    arrays = {"tokens": tokens, "targets": targets, "mask": tmask}
  chunk = n_rows if batch_size is None else batch_size
  n_chunks = -(-n_rows // chunk) if n_rows else 0
  extra = n_chunks * chunk - n_rows
  pad_value = {"positions": -1}
  arrays = {k: np.concatenate([a, np.full((extra, width), pad_value.get(k, 0), a.dtype)])
            for k, a in arrays.items()}
  max_docs = None
  if pack:
    docs_per_row = np.array([len(r) for r in rows] + [0] * extra)
    max_docs = max(1, int(docs_per_row.reshape(n_chunks, chunk).sum(1).max()))
  out = np.zeros((n_chunks * chunk, width), np.float32)
  for i in range(n_chunks):
    sl = slice(i * chunk, (i + 1) * chunk)
    out[sl] = np.asarray(_rows_logp_jit(
        model, arrays["tokens"][sl], arrays["targets"][sl], arrays["mask"][sl],
        arrays["positions"][sl] if pack else None, arrays["segment_ids"][sl] if pack else None,
        temperature=float(temperature), max_docs=max_docs, tp_mesh=tp_mesh))
  result = np.zeros((b, t), np.float32)
  for s in range(b):
    n = lengths[s]
    if n > 1:  # out[.., c + j] scores token j + 1 of the sequence
      result[s, 1:n] = out[at_row[s], at_col[s]:at_col[s] + n - 1]
  return jnp.asarray(np.where(cm, result, np.float32(0)))
