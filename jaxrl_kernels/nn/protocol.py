"""The causal-LM protocol of :func:`~jaxrl_kernels.nn.sample` and
:func:`~jaxrl_kernels.nn.score`, and what every model implementing it shares.

:class:`CausalLM` (the methods a model provides), :class:`KVCache` (the explicit cache
pytree), :class:`Documents` / :func:`documents` (where each document of a packed or padded
``[B, T]`` layout lives, for the aligned attention that makes decode == prefill), and the
entry checks: :func:`check_token_ids` and :func:`embed_ids` (ids in ``[0, V)``, eagerly or
as NaN embeddings under ``jit``) and :func:`check_prefill` (a prefill's shapes, lengths and
inert padding). :class:`~jaxrl_kernels.nn.TinyCausalLM` and
:class:`~jaxrl_kernels.models.DecoderLM` both build on it.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_kernels import _validation
from jaxrl_kernels.reduce.segment import take_rows


class CausalLM(Protocol):
  """What :func:`sample` and :func:`score` need from a model.

  Attributes / methods:
    config: has ``vocab_size``.
    head: the :class:`~jaxrl_kernels.nn.LMHead` reading the final hidden states (or an
      object with its ``logits(h, temperature, return_stats)`` and ``__call__``, as
      ``models.ShardedHead``).
    __call__(tokens, positions=None, segment_ids=None, *, max_docs=None): hidden ``[B, T, H]``.
    logp(tokens, targets, mask=None, *, positions, segment_ids, max_docs, temperature):
      float32 ``[B, T]`` log-probs through ``head``.
    init_cache(batch, max_len) -> KVCache; prefill(tokens, lengths, cache) ->
      (hidden ``[B, H]``, cache); decode_step(token, cache) -> (hidden ``[B, H]``, cache),
      with decode == prefill bitwise. Optionally ``decode_weights()``: weights made once
      before the decode loop, then passed as ``decode_step(token, cache, weights=...)``.
  """

  head: object  # an LMHead, or an object with its logits() and __call__

  def __call__(self, tokens, positions=None, segment_ids=None, *, max_docs=None): ...

  def logp(self, tokens, targets, mask=None, *, positions=None, segment_ids=None,
           max_docs=None, temperature=1.0, return_entropy=False): ...

  def init_cache(self, batch: int, max_len: int) -> KVCache: ...

  def prefill(self, tokens, lengths, cache: KVCache): ...

  def decode_step(self, token, cache: KVCache): ...


class Documents(NamedTuple):
  """Where each document of a ``[B, T]`` layout lives, for the aligned attention.

  A document is a maximal run of tokens of one row with position >= 0, one
  segment id, and positions increasing by 1; its token at position ``p`` goes
  to slot ``p`` of its aligned row. ``row, col0, length``: ``[N]`` (the row,
  the column of slot 0, the number of tokens); ``doc, slot``: ``[B, T]``;
  ``live``: tokens in a valid document; ``bad``: tokens in a document past
  ``max_docs`` or not starting at position 0 (their outputs become NaN).
  """

  row: jax.Array
  col0: jax.Array
  length: jax.Array
  doc: jax.Array
  slot: jax.Array
  live: jax.Array
  bad: jax.Array

  def gather(self, x: jax.Array) -> jax.Array:
    """``[B, T, ...]`` -> ``[N, T, ...]``, document ``n`` left-aligned in row ``n``, zeros after.

    Its gradient is the inverse gather (each token reads its slot's cotangent), not the
    scatter-add that autodiff of a gather would run: a token is in at most one slot."""
    return _doc_gather(x, self)

  def query_positions(self, t: int) -> jax.Array:
    """``[N, T]`` int32 positions of the aligned rows' queries: slot ``j`` of document ``n``
    is at position ``j``; slots at or past its length are -1, queries that see no key. The
    attention kernels skip a block of such rows whole, so a short document costs its own
    length, not the row's; the document's queries keep their bits (a query's bits depend on
    its position and the keys it sees, never on its block-mates)."""
    j = jnp.arange(t, dtype=jnp.int32)
    return jnp.where(j < self.length[:, None], j, -1)

  def scatter(self, y: jax.Array) -> jax.Array:
    """``[N, T, ...]`` -> ``[B, T, ...]``: each token reads its document's slot; padding
    tokens get 0, tokens of ``bad`` documents NaN.

    Its gradient is a gather too (each live token's slot reads that token's cotangent)."""
    return _doc_scatter(y, self)


def _expand(mask: jax.Array, ndim: int) -> jax.Array:
  return mask.reshape(*mask.shape, *(1,) * (ndim - mask.ndim))


def _slots_of(docs: Documents, x: jax.Array) -> jax.Array:
  """``[N, T, ...]``: slot ``j`` of document ``n`` reads token ``(row[n], col0[n] + j)`` for
  ``j < length[n]``, zeros after (every document the layout names, live or not)."""
  t = x.shape[1]
  j = jnp.arange(t)
  cols = jnp.clip(docs.col0[:, None] + j, 0, t - 1)
  keep = _expand(j < docs.length[:, None], x.ndim)
  return jnp.where(keep, x[docs.row[:, None], cols], jnp.zeros((), x.dtype))


def _tokens_of(docs: Documents, y: jax.Array, member: jax.Array) -> jax.Array:
  """``[B, T, ...]``: token ``(b, t)`` reads slot ``t - col0[doc]`` of its document where
  ``member``, zeros elsewhere."""
  t = y.shape[1]
  rel = jnp.clip(jnp.arange(t)[None, :] - docs.col0[docs.doc], 0, t - 1)
  return jnp.where(_expand(member, y.ndim), y[docs.doc, rel], jnp.zeros((), y.dtype))


def _in_slot(docs: Documents, t: int) -> jax.Array:
  """``[B, T]``: the token is slot ``t - col0[doc]`` of document ``doc`` (the slots
  :func:`_slots_of` fills): its row, and ``0 <= t - col0 < length``."""
  b = docs.doc.shape[0]
  rel = jnp.arange(t)[None, :] - docs.col0[docs.doc]
  return ((docs.live | docs.bad) & (docs.row[docs.doc] == jnp.arange(b)[:, None])
          & (rel >= 0) & (rel < docs.length[docs.doc]))


# Each token is in at most one slot and each slot holds at most one token, so the
# transpose of either data movement is the other direction's gather, where autodiff of a
# gather runs a scatter-add (slower on a GPU; tests/nn/test_documents.py checks the values
# against it). The integer document arrays get no cotangent (None).
@jax.custom_vjp
def _doc_gather(x, docs):
  return _slots_of(docs, x)


def _doc_gather_fwd(x, docs):
  return _slots_of(docs, x), docs


def _doc_gather_bwd(docs, dy):
  return _tokens_of(docs, dy, _in_slot(docs, dy.shape[1])), None


_doc_gather.defvjp(_doc_gather_fwd, _doc_gather_bwd)


@jax.custom_vjp
def _doc_scatter(y, docs):
  out = jnp.where(_expand(docs.live, y.ndim), y[docs.doc, docs.slot], jnp.zeros((), y.dtype))
  return jnp.where(_expand(docs.bad, y.ndim), jnp.full((), jnp.nan, y.dtype), out)


def _doc_scatter_fwd(y, docs):
  return _doc_scatter(y, docs), docs


def _doc_scatter_bwd(docs, dout):
  # Slot j of document n holds token (row[n], col0[n] + j) where that token is live.
  live = jnp.where(_expand(docs.live, dout.ndim), dout, jnp.zeros((), dout.dtype))
  return _slots_of(docs, live), None


_doc_scatter.defvjp(_doc_scatter_fwd, _doc_scatter_bwd)


def documents(positions: jax.Array, segment_ids: jax.Array, max_docs: int, *,
              op: str = "TinyCausalLM") -> Documents:
  """The :class:`Documents` of a ``[B, T]`` layout (``positions``, ``segment_ids``) for
  attention on ``[max_docs, T]`` left-aligned rows; ``op`` names the caller in errors."""
  b, t = positions.shape
  pos = positions.astype(jnp.int32)
  active = pos >= 0
  cont = jnp.zeros((b, t), bool).at[:, 1:].set(
      active[:, :-1] & (segment_ids[:, 1:] == segment_ids[:, :-1])
      & (pos[:, 1:] == pos[:, :-1] + 1))
  start = active & ~cont
  gid = (jnp.cumsum(start.reshape(-1)) - 1).reshape(b, t).astype(jnp.int32)  # document id
  flat = jnp.arange(b * t, dtype=jnp.int32).reshape(b, t)
  at_start = jnp.where(start, gid, max_docs).reshape(-1)  # out-of-range ids are dropped
  first = jnp.zeros((max_docs,), jnp.int32).at[at_start].set(flat.reshape(-1), mode="drop")
  first_pos = jnp.full((max_docs,), -1, jnp.int32).at[at_start].set(pos.reshape(-1), mode="drop")
  length = jnp.zeros((max_docs,), jnp.int32).at[jnp.where(active, gid, max_docs).reshape(-1)].add(
      1, mode="drop")
  doc = jnp.clip(gid, 0, max_docs - 1)
  live = active & (gid < max_docs) & (first_pos[doc] == 0)
  if not any(isinstance(a, jax.core.Tracer) for a in (positions, segment_ids)):
    n = int(np.sum(np.asarray(start)))
    if n > max_docs:
      raise ValueError(f"{op}: the layout holds {n} documents but max_docs={max_docs}; "
                       f"pass max_docs >= {n}")
    bad_start = np.argwhere(np.asarray(start) & (np.asarray(pos) != 0))
    if bad_start.size:
      r, c = (int(i) for i in bad_start[0])
      raise ValueError(f"{op}: a document must start at position 0, but the one at "
                       f"row {r}, column {c} starts at position {int(pos[r, c])}")
  return Documents(row=first // t, col0=first % t, length=length, doc=doc,
                   slot=jnp.clip(pos, 0, t - 1), live=live, bad=active & ~live)


class KVCache(NamedTuple):
  """Per-layer keys and values ``[B, max_len, heads, d]`` (activation dtype, after
  rotary) and ``lengths [B]`` int32: row ``b`` holds positions ``0..lengths[b]-1``."""

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  lengths: jax.Array

  @property
  def max_len(self) -> int:
    return self.keys[0].shape[1]


def is_traced(*xs) -> bool:
  """True when any argument is a tracer (``None`` arguments are ignored)."""
  return not _validation.is_concrete(*xs)


def check_token_ids(op: str, name: str, ids, vocab_size: int, mask=None) -> jax.Array:
  """``ids`` as int32, checked to lie in ``[0, vocab_size)`` where ``mask`` (everywhere
  without one): eagerly when concrete (ValueError naming ``name``, the first bad index and
  value, and V), with ``checkify.debug_check`` when traced (:func:`embed_ids` then makes an
  out-of-range id's embedding NaN)."""
  ids = _validation.as_ids(op, name, ids)
  _validation.check_ids_in_range(op, name, ids, vocab_size, mask)
  return ids


def check_decode_token(op: str, token, cache: KVCache, vocab_size: int) -> jax.Array:
  """A decode step's ``token``: int32 ids in ``[0, vocab_size)`` (:func:`check_token_ids`)
  of shape ``[B]``, one per cache row (ValueError naming ``token`` otherwise)."""
  token = check_token_ids(op, "token", token, vocab_size)
  b = cache.lengths.shape[0]
  if token.shape != (b,):
    raise ValueError(f"{op}: token must have shape ({b},), got {token.shape}")
  return token


def finish_decode(h: jax.Array, cache: KVCache, keys, values) -> tuple[jax.Array, KVCache]:
  """A decode step's result: ``(h [B, H], cache)`` with the new ``keys``/``values`` and
  ``lengths + 1``; a row whose cache was full (``lengths == max_len``: it wrote nothing)
  keeps its length and gets a NaN hidden state."""
  lengths = cache.lengths
  full = lengths >= cache.max_len
  h = jnp.where(full[:, None], jnp.full((), jnp.nan, h.dtype), h)
  return h, KVCache(tuple(keys), tuple(values), jnp.where(full, lengths, lengths + 1))


def embed_ids(embed, ids: jax.Array, vocab_size: int) -> jax.Array:
  """``embed(ids)`` where ``ids`` lie in ``[0, vocab_size)``, NaN rows elsewhere: a traced
  out-of-range id never gives a finite (wrapped, zero or clamped) embedding, the same with
  the table sharded or not. In-range ids give ``embed``'s bits.

  An ``nnx.Embed`` table is read with :func:`~jaxrl_kernels.reduce.segment.take_rows`
  (``nnx.Embed``'s cast and ``jnp.take``), whose gradient adds the tokens' rows in a fixed
  order: XLA's GPU scatter-add would add them with atomics, so the embedding's gradient
  would change its bits from run to run."""
  ok = (ids >= 0) & (ids < vocab_size)
  safe = jnp.where(ok, ids, 0)
  if isinstance(embed, nnx.Embed):
    table = embed.embedding.get_value()
    x = take_rows(table.astype(embed.dtype or table.dtype), safe)
  else:
    x = embed(safe)
  return jnp.where(ok[..., None], x, jnp.full((), jnp.nan, x.dtype))


def check_prefill(op: str, tokens, lengths, cache: KVCache, vocab_size: int | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """``(tokens [B, P], lengths [B] int32)`` of a KV-cache prefill, checked against the cache:
  one batch size, prompts that fit ``max_len``, and (when concrete) lengths in ``[1, P]``.
  With ``vocab_size``: ids before ``lengths`` must lie in ``[0, V)`` (see
  :func:`check_token_ids`), and the padding after them is replaced by 0, so that it is
  inert whatever its value (V, -100)."""
  tokens = _validation.as_ids(op, "tokens", tokens)
  lengths = jnp.asarray(lengths, jnp.int32)
  if tokens.ndim != 2:
    raise ValueError(f"{op}: tokens must be [B, P], got shape {tokens.shape}")
  b, p = tokens.shape
  if cache.keys[0].shape[0] != b or lengths.shape != (b,):
    raise ValueError(f"{op}: tokens {tokens.shape}, lengths {lengths.shape} and the cache's "
                     f"batch {cache.keys[0].shape[0]} must agree on B={b}")
  if p > cache.max_len:
    raise ValueError(f"{op}: prompts of {p} tokens do not fit a cache of max_len={cache.max_len}")
  if not is_traced(lengths):
    ls = np.asarray(lengths)
    if not np.all((ls >= 1) & (ls <= p)):
      raise ValueError(f"{op}: lengths must lie in [1, {p}], got {ls.tolist()}")
  if vocab_size is not None:
    active = jnp.arange(p, dtype=jnp.int32)[None, :] < lengths[:, None]
    _validation.check_ids_in_range(op, "tokens", tokens, vocab_size, active)
    tokens = jnp.where(active, tokens, 0)
  return tokens, lengths
