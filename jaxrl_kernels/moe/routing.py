"""Routing that cannot flip: each token's experts and weights from its own router row.

Every step is row-local and written out in a fixed order, so a token's choice and
weights are bitwise independent of the batch, of padding and of the token's place:

* the router logits come from the invariant GEMM (``det_matmul``);
* :func:`router_probs`: float32 softmax over the experts, ``exp`` from IEEE basic
  operations (``softmax_partials.exp_arith``, guarded against FMA contraction: the
  same bits in every program and on every device), the denominator a fixed pairwise
  tree over the experts (zero-padded to a power of two);
* :func:`route`: top-k by repeated first-maximum (ties go to the lowest expert
  index), weights normalized over the k chosen (``normalize=True``: Mixtral,
  Qwen3-MoE with ``norm_topk_prob``) with the k-sum in rank order.

Gradients: the softmax's backward is hand-written with the same fixed tree; the
rest is element-wise per row (one-hot selections, sums over k in rank order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels import _validation
from jaxrl_kernels._cpu import guard, opaque_zero, tree_sum
from jaxrl_kernels.pallas.softmax_partials import exp_arith
from jaxrl_kernels.reduce import det_sum


def _row_sum(x: jax.Array) -> jax.Array:
  """:func:`tree_sum` of ``x`` computed first: the barrier keeps XLA from fusing the guarded
  ``exp_arith`` into every leaf of the tree's slices (at 128 experts that one fusion took
  ~50 s of GPU compile; the values are the same)."""
  return tree_sum(lax.optimization_barrier(x))


@jax.custom_vjp
def router_probs(logits: jax.Array) -> jax.Array:
  """float32 ``softmax(logits, axis=-1)``, row-local and in a fixed order (module docstring).

  Args:
    logits: ``[..., E]`` float32 router logits.

  Returns:
    ``[..., E]`` float32 probabilities.
  """
  if logits.dtype != jnp.float32:
    raise TypeError(f"router_probs: logits must be float32, got {logits.dtype}")
  x = logits
  zero = opaque_zero(x)
  e = exp_arith(x - jnp.max(x, axis=-1, keepdims=True), sep=lambda v: guard(v, zero))
  return e / _row_sum(e)[..., None]


def _probs_fwd(logits):
  p = router_probs(logits)
  return p, p


def _probs_bwd(p, g):
  zero = opaque_zero(p)
  gp = guard(g.astype(jnp.float32) * p, zero)
  # d logits = p * (g - sum_j g_j p_j), the sum the same fixed tree as the forward's.
  return (guard(p * (g - _row_sum(gp)[..., None]), zero),)


router_probs.defvjp(_probs_fwd, _probs_bwd)


def check_k(op: str, k, num_experts: int) -> int:
  """``k`` as an ``int`` in ``[1, num_experts]`` (a TypeError for a bool or a float, a
  ValueError naming the range otherwise)."""
  k = _validation.check_int(op, "k", k)
  if not 1 <= k <= num_experts:
    raise ValueError(f"{op}: k must be in [1, {num_experts}] (the number of experts), got {k}")
  return k


def route(logits: jax.Array, k: int, *, normalize: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Top-``k`` experts and their weights per token.

  Args:
    logits: ``[T, E]`` router logits.
    k: experts per token (``1 <= k <= E``).
    normalize: divide the chosen probabilities by their sum (``norm_topk_prob``).

  Returns:
    ``(weights [T, k] float32, experts [T, k] int32, probs [T, E] float32)``, ranks in
    descending probability, equal probabilities in ascending expert index. A NaN row
    stays NaN (its weights are NaN), never silently routed.
  """
  k = check_k("route", k, logits.shape[-1])
  probs = router_probs(logits.astype(jnp.float32))
  iota = lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
  left = probs
  experts, chosen = [], []
  for _ in range(k):
    idx = jnp.argmax(left, axis=-1).astype(jnp.int32)  # the first maximum: lowest index
    chosen.append(jnp.take_along_axis(probs, idx[..., None], axis=-1)[..., 0])
    experts.append(idx)
    left = jnp.where(iota == idx[..., None], -jnp.inf, left)
  if normalize:
    total = chosen[0]
    for c in chosen[1:]:
      total = total + c
    chosen = [c / total for c in chosen]
  return jnp.stack(chosen, axis=-1), jnp.stack(experts, axis=-1), probs


def _mask_weights(op: str, mask, t: int) -> jax.Array:
  """float32 ``[T]`` token weights (ones without a mask); the mask's shape is checked (a
  ``[1]`` or ``[T, 1]`` mask would broadcast silently)."""
  if mask is None:
    return jnp.ones((t,), jnp.float32)
  if jnp.shape(mask) != (t,):
    raise ValueError(f"{op}: mask must have shape ({t},) (one entry per token), got "
                     f"{jnp.shape(mask)}")
  return jnp.asarray(mask).astype(jnp.float32)


def _masked(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x * w`` where ``w != 0``, exactly 0 elsewhere: a select, so a NaN or inf at a masked
  token reaches neither the loss nor any gradient (``NaN * 0`` would)."""
  return jnp.where(w != 0, x * w, jnp.zeros((), x.dtype))


def _mean(total: jax.Array, count: jax.Array) -> jax.Array:
  """``total / count``, 0 when nothing counts (never NaN; a 0/1 mask's count is 0 or >= 1)."""
  return total / jnp.where(count > 0, count, jnp.ones((), count.dtype))


def load_balancing_loss(probs: jax.Array, experts: jax.Array, mask: jax.Array | None = None, *,
                        implementation: str | None = None) -> jax.Array:
  """The switch-transformer load-balancing loss, as ``transformers``' Mixtral/Qwen3-MoE.

  ``E * sum_{j, e} f[j, e] * P[e]``: ``f[j, e]`` the fraction of (unmasked) tokens whose
  rank-``j`` expert is ``e``, ``P[e]`` the mean router probability of expert ``e``.
  Means over tokens are fixed-order sums (``det_sum``): deterministic run to run. Masked
  tokens are selected out (a NaN there changes nothing); with no unmasked token the loss
  is 0.

  Args:
    probs: ``[T, E]`` router probabilities (:func:`route`'s third result; several layers
      concatenated along T, as ``transformers`` does).
    experts: ``[T, k]`` chosen experts, in ``[0, E)`` at unmasked tokens (concrete: a
      ValueError otherwise; traced: the loss is NaN).
    mask: ``[T]`` bool or 0/1, the tokens that count (None: all).
  """
  op = "load_balancing_loss"
  if jnp.ndim(probs) != 2:
    raise ValueError(f"{op}: probs must be [T, E], got shape {jnp.shape(probs)}")
  t, num_experts = probs.shape
  if jnp.ndim(experts) != 2 or experts.shape[0] != t:
    raise ValueError(f"{op}: experts must have shape ({t}, k) (probs is {probs.shape}), got "
                     f"{jnp.shape(experts)}")
  w = _mask_weights(op, mask, t)
  active = jnp.broadcast_to((w != 0)[:, None], experts.shape)
  _validation.check_ids_in_range(op, "experts", experts, num_experts, active)
  outside = active & ((experts < 0) | (experts >= num_experts))
  onehot = (experts[..., None] == jnp.arange(num_experts)).astype(jnp.float32)  # [T, k, E]
  count = det_sum(w, implementation=implementation)
  f = _mean(det_sum(onehot * w[:, None, None], axis=0, implementation=implementation), count)
  p = _mean(det_sum(_masked(probs.astype(jnp.float32), w[:, None]), axis=0,
                    implementation=implementation), count)
  loss = num_experts * det_sum(f * p[None, :], implementation=implementation)
  # An expert id outside [0, E) would count for no expert: never a silent finite loss.
  return jnp.where(jnp.any(outside), jnp.full((), jnp.nan, loss.dtype), loss)


def router_z_loss(logits: jax.Array, mask: jax.Array | None = None, *,
                  implementation: str | None = None) -> jax.Array:
  """ST-MoE's router z-loss: the mean over (unmasked) tokens of ``logsumexp(logits)^2``;
  masked tokens selected out, 0 with none unmasked. ``logits [T, E]``, ``mask [T]``."""
  if jnp.ndim(logits) != 2:
    raise ValueError(f"router_z_loss: logits must be [T, E], got shape {jnp.shape(logits)}")
  w = _mask_weights("router_z_loss", mask, logits.shape[0])
  # Masked rows read as 0 before the exp: their gradient is then 0, not 0 * NaN.
  x = jnp.where((w != 0)[:, None], logits.astype(jnp.float32), jnp.zeros((), jnp.float32))
  m = jnp.max(x, axis=-1)
  zero = opaque_zero(x)
  lse = m + jnp.log(_row_sum(exp_arith(x - m[..., None], sep=lambda v: guard(v, zero))))
  return _mean(det_sum(_masked(lse * lse, w), implementation=implementation),
               det_sum(w, implementation=implementation))
