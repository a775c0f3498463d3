"""``vocab_parallel_linear_objective``: ``linear_objective`` (a loss of the head's log-probs
with its gradient formed in the forward pass) with the LM head's vocabulary sharded over a
mesh axis, inside ``shard_map``.

The forward pass runs the vocab-parallel head (``vocab_parallel_linear_logp``'s forward: each
device's vocabulary tiles, the partials gathered and folded in the global tile order, so
``logp`` and ``entropy`` are bitwise the unsharded ``linear_logp``'s for every TP degree with
``merge="all_gather"``), the objective and its per-token cotangents (the same on every
device: the objective sees the replicated ``logp`` and ``entropy``), and each device's
backward kernels over its own vocabulary shard: its dW (and db) shard and its term of dH.
The ``custom_vjp`` backward scales them by the loss cotangent; JAX sums the dH terms over the
axis, as for ``vocab_parallel_linear_logp`` (within CONTRACT section 2 of the unsharded dH,
not TP-bitwise). The head runs four GEMMs here (``BackwardConfig(passes=3)`` applies to the
unsharded head only).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels import _validation
from jaxrl_kernels.linear_logp import api, objective, vocab_parallel
from jaxrl_kernels.linear_logp.config import BackwardConfig

_OP = "vocab_parallel_linear_objective"


@dataclasses.dataclass(frozen=True)
class _Static:
  head: vocab_parallel._Static  # entropy=True: the forward always computes the entropy
  objective: Callable  # objective(logp, entropy, operands, cfg) -> (loss, aux)
  cfg: Any
  entropy_grad: bool
  lead: tuple[int, ...]
  hidden_dtype: str
  bias_dtype: str | None


def _primal(hidden, weight, bias, temp, targets, mask, operands, st: _Static):
  (logp, ent), _ = vocab_parallel._forward(hidden, weight, bias, temp, targets, mask, st.head)
  loss, aux = st.objective(logp.reshape(st.lead), ent.reshape(st.lead), operands, st.cfg)
  return objective._scalar(loss), aux, logp, ent


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _fused(hidden, weight, bias, temp, targets, mask, operands, st):
  return _primal(hidden, weight, bias, temp, targets, mask, operands, st)


def _fused_fwd(hidden, weight, bias, temp, targets, mask, operands, st: _Static):
  head = st.head
  (logp, ent), (lse, mean_z, local_t) = vocab_parallel._forward(hidden, weight, bias, temp,
                                                                targets, mask, head)
  (loss, aux), (g_logp, g_ent) = objective._losses(logp, ent, operands, st)
  g_logp, g_ent = api.masked_cotangents((g_logp, g_ent), targets, mask, head.vocab_size)
  if not st.entropy_grad:
    g_ent = jnp.zeros_like(g_ent)

  def local(valid):
    return api.backend(head.implementation).backward(
        hidden, weight, bias, local_t, lse, mean_z, g_logp, g_ent, layout=head.layout,
        temperature=1.0 if temp is None else temp, compute_dtype=head.compute_dtype,
        vocab_offset=0, valid_vocab=valid, config=head.config, entropy=st.entropy_grad)

  dh, dw, db = vocab_parallel._per_valid(head, local)
  return (loss, aux, logp, ent), objective._named(dh, dw, db)


def _fused_bwd(st: _Static, res, cts):
  ct = jnp.asarray(cts[0], jnp.float32)
  if not st.head.check_vma:
    # shard_map(check_vma=False) hands each device 1/tp of a replicated output's
    # cotangent: the sum restores it (as vocab_parallel_linear_logp's backward does).
    ct = lax.psum(ct, st.head.axis_name)
  dh, dw, db = objective.scaled(res, ct, st.hidden_dtype, st.bias_dtype)
  return dh, dw, db, None, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def vocab_parallel_linear_objective(hidden: jax.Array, weight_shard: jax.Array,
                                    targets: jax.Array, objective_fn: Callable,
                                    operands: Any = None, *, axis_name, vocab_size: int,
                                    cfg: Any = None, entropy_grad: bool = True,
                                    mask: jax.Array | None = None,
                                    bias_shard: jax.Array | None = None,
                                    temperature: float | jax.Array = 1.0,
                                    weight_layout: str = "hv", fp32_head: bool = False,
                                    merge: str = "all_gather",
                                    implementation: str | None = None,
                                    config: BackwardConfig | None = None,
                                    validate: bool = False):
  """``objective_fn(logp, entropy)`` of a vocab-parallel LM head, its gradient formed in the
  forward pass. Call it inside ``shard_map``, as
  :func:`~jaxrl_kernels.linear_logp.vocab_parallel_linear_logp`.

  Args:
    hidden, weight_shard, targets, axis_name, vocab_size, mask, bias_shard, temperature,
      weight_layout, fp32_head, merge, implementation, config, validate: as in
      ``vocab_parallel_linear_logp`` (``hidden``, ``targets``, ``mask`` and ``operands`` the
      same on every device of ``axis_name``).
    objective_fn, operands, cfg, entropy_grad: as in
      :func:`~jaxrl_kernels.linear_logp.objective.linear_objective` (``objective``,
      ``operands``, ``cfg``, ``entropy_grad``).

  Returns:
    ``(loss, aux, logp, entropy)`` as ``linear_objective``, the same on every device of
    ``axis_name``: ``logp`` and ``entropy`` bitwise ``vocab_parallel_linear_logp``'s (with
    ``merge="all_gather"``, the unsharded ``linear_logp``'s), so the loss and ``aux`` too for
    a deterministic objective. Gradients (of ``jax.grad`` outside the ``shard_map``): dW and
    db per shard, dH summed over ``axis_name`` by JAX; they equal the unfused
    ``objective_fn(vocab_parallel_linear_logp(...))`` composition's to float rounding.
  """
  _validation.check_bool(_OP, "entropy_grad", entropy_grad)
  if not callable(objective_fn):
    raise TypeError(f"{_OP}: objective_fn must be a function (logp, entropy, operands, cfg) "
                    f"-> (loss, aux), got {objective_fn!r}")
  prepared = vocab_parallel.prepare(
      _OP, hidden, weight_shard, targets, axis_name=axis_name, vocab_size=vocab_size,
      mask=mask, bias_shard=bias_shard, temperature=temperature, return_entropy=True,
      weight_layout=weight_layout, fp32_head=fp32_head, merge=merge,
      implementation=implementation, config=config, validate=validate)
  lead = prepared.lead
  if prepared.args is None:
    logp = ent = jnp.zeros(lead, jnp.float32)
    loss, aux = objective_fn(logp, ent, operands, cfg)
    return objective._scalar(loss), lax.stop_gradient(aux), logp, ent
  h2, _, bias = prepared.args[:3]
  st = _Static(prepared.static, objective_fn, cfg, bool(entropy_grad), tuple(lead),
               h2.dtype.name, None if bias is None else bias.dtype.name)
  loss, aux, logp, ent = _fused(*prepared.args, operands, st)
  return (loss, lax.stop_gradient(aux), lax.stop_gradient(logp.reshape(lead)),
          lax.stop_gradient(ent.reshape(lead)))
