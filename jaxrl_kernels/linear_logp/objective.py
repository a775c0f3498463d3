"""``linear_objective``: a scalar objective of the head's log-probs with its gradient formed in
the forward pass.

For a loss ``L = objective(logp, entropy)`` of the token log-probs and entropies of an LM head
(``logp``, ``entropy`` as :func:`~jaxrl_kernels.linear_logp.linear_logp` gives them), the
forward pass runs

1. the head's forward kernels: ``logp``, ``entropy`` and the residuals ``lse``, ``mean_z``
   (the very kernels of ``linear_logp``: the same bits);
2. ``jax.vjp`` of ``objective`` at ``(logp, entropy)`` with a loss cotangent of 1: the
   per-token cotangents ``g_logp``, ``g_ent`` (any objective: token-level, sequence-level,
   with global counts over mesh axes);
3. the head's backward kernels with those cotangents: ``dH``, ``dW``, ``db``.

The ``custom_vjp`` backward then only scales the stored gradients by the loss cotangent
(in float32, then rounded to the parameter's dtype). The head's kernels get the per-token
cotangents that ``jax.grad(objective(linear_logp(...)))`` would give them, so the gradients
equal that composition's to float rounding (the objective's own element-wise gradient is XLA
code compiled into another program); a power-of-two loss cotangent scales them exactly; for
a 16-bit weight another cotangent ``c`` gives ``c`` times its rounded ``dW`` (one rounding
more than the unfused composition).

The head's work is the same as ``linear_logp`` forward + backward (one logits GEMM forward,
the logits GEMM again and the dH and dW GEMMs after), all of it in the forward pass: a
``jax.grad`` step finds nothing left to do for the head in its backward pass, and the
stored gradients are tagged ``jax.ad_checkpoint.checkpoint_name(..., "linear_objective")``
so that a ``jax.checkpoint`` policy can keep them instead of running the head again
(``jax.checkpoint_policies.save_only_these_names("linear_objective")``).

**Three GEMMs** (``config=BackwardConfig(passes=3)`` with a ``token_grad``): for a token-level
objective, whose cotangent at token ``t`` is a function of token ``t``'s ``logp`` and
``entropy`` and of values known before the pass (``token_operands``: advantages, old
log-probs, per-token weights such as ``1 / N`` of a global count), steps 1 to 3 run per token
chunk with the logits computed once (:mod:`jaxrl_kernels.linear_logp.three_gemm`): the chunk's
logits GEMM, their statistics (``logp`` and ``entropy`` bitwise ``linear_logp``'s), the
cotangents by ``token_grad``, dz, the dH and dW GEMMs. The loss and ``aux`` are then
``objective`` of all the tokens' values, as on the four-GEMM path. An objective without a
``token_grad`` (a sequence-level one, GSPO) runs the four-GEMM path whatever ``passes`` says.

The returned ``logp``, ``entropy`` and ``aux`` carry no gradient (they are metrics):
differentiate through :func:`~jaxrl_kernels.linear_logp.linear_logp` to use them in another
loss.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxrl_kernels import _validation
from jaxrl_kernels.linear_logp import api, three_gemm
from jaxrl_kernels.linear_logp.config import BackwardConfig

_OP = "linear_objective"
CHECKPOINT_NAME = "linear_objective"


@dataclasses.dataclass(frozen=True)
class _Static:
  head: api._Static  # the forward's statics (entropy=True: the entropy is always returned)
  objective: Callable  # objective(logp, entropy, operands, cfg) -> (loss, aux)
  cfg: Any  # hashable static configuration of the objective
  entropy_grad: bool  # the objective reads the entropy (else the backward may leave it out)
  lead: tuple[int, ...]  # the token shape the objective sees (the head works on [T] rows)
  hidden_dtype: str
  bias_dtype: str | None
  token_grad: Callable | None = None  # set: the three-GEMM path (token-level objective)
  token_chunk: int = three_gemm.DEFAULT_TOKEN_CHUNK


def _losses(logp, ent, operands, st: _Static):
  """``(loss, aux), (g_logp, g_ent)`` of the objective at ``(logp, entropy)``."""
  def fn(lp, en):
    loss, aux = st.objective(lp.reshape(st.lead), en.reshape(st.lead), operands, st.cfg)
    return _scalar(loss), aux

  loss, vjp, aux = jax.vjp(fn, logp, ent, has_aux=True)
  g_logp, g_ent = vjp(jnp.ones((), loss.dtype))
  return (loss, aux), (g_logp, g_ent)


def _scalar(loss) -> jax.Array:
  loss = jnp.asarray(loss)
  if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
    raise ValueError(f"{_OP}: the objective must return a float scalar loss, got "
                     f"{loss.dtype} {loss.shape}")
  return loss.astype(jnp.float32)


def _primal(hidden, weight, bias, temp, targets, mask, operands, st: _Static):
  (logp, ent), _ = api._forward(hidden, weight, bias, temp, targets, mask, st.head)
  loss, aux = st.objective(logp.reshape(st.lead), ent.reshape(st.lead), operands[0], st.cfg)
  return _scalar(loss), aux, logp, ent


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _fused(hidden, weight, bias, temp, targets, mask, operands, st):
  return _primal(hidden, weight, bias, temp, targets, mask, operands, st)


def _three_gemm_fwd(hidden, weight, bias, temp, targets, mask, operands, st: _Static):
  """The loss and the head's gradients with the logits computed once per token chunk."""
  ops, token_ops = operands

  def cotangents(logp, ent, token_ops_c, targets_c, active_c):
    g = st.token_grad(logp, ent, token_ops_c, st.cfg)
    return api.masked_cotangents(g, targets_c, active_c, st.head.vocab_size)

  logp, ent, dh, dw, db = three_gemm.run(
      hidden, weight, bias, temp, targets, mask, cotangents, token_ops,
      implementation=st.head.implementation, layout=st.head.layout,
      compute_dtype=st.head.compute_dtype, vocab_size=st.head.vocab_size,
      token_chunk=st.token_chunk, entropy_grad=st.entropy_grad,
      backend=api.backend(st.head.implementation))
  loss, aux = st.objective(logp.reshape(st.lead), ent.reshape(st.lead), ops, st.cfg)
  # One rounding of the float32 accumulator to the weight's dtype, as the GEMM backward's.
  return (_scalar(loss), aux, logp, ent), (dh, dw.astype(weight.dtype), db)


def _fused_fwd(hidden, weight, bias, temp, targets, mask, operands, st):
  if st.token_grad is not None:
    out, (dh, dw, db) = _three_gemm_fwd(hidden, weight, bias, temp, targets, mask, operands,
                                        st)
    return out, _named(dh, dw, db)
  (logp, ent), (lse, mean_z) = api._forward(hidden, weight, bias, temp, targets, mask, st.head)
  (loss, aux), (g_logp, g_ent) = _losses(logp, ent, operands[0], st)
  g_logp, g_ent = api.masked_cotangents((g_logp, g_ent), targets, mask, st.head.vocab_size)
  if not st.entropy_grad:
    g_ent = jnp.zeros_like(g_ent)
  dh, dw, db = api.backend(st.head.implementation).backward(
      hidden, weight, bias, targets, lse, mean_z, g_logp, g_ent, layout=st.head.layout,
      temperature=1.0 if temp is None else temp, compute_dtype=st.head.compute_dtype,
      config=st.head.config, entropy=st.entropy_grad)
  return (loss, aux, logp, ent), _named(dh, dw, db)


def _named(dh, dw, db):
  """The stored gradients, tagged for ``jax.checkpoint`` policies."""
  dh, dw = checkpoint_name(dh, CHECKPOINT_NAME), checkpoint_name(dw, CHECKPOINT_NAME)
  if db is not None:
    db = checkpoint_name(db, CHECKPOINT_NAME)
  return dh, dw, db


def scaled(grads, ct, hidden_dtype: str, bias_dtype: str | None):
  """The stored ``(dh, dw, db)`` times the float32 loss cotangent ``ct``, each rounded to its
  parameter's dtype."""
  dh, dw, db = grads
  dh = (ct * dh).astype(hidden_dtype)
  dw = (ct * dw.astype(jnp.float32)).astype(dw.dtype)
  if db is not None:
    db = (ct * db).astype(bias_dtype)
  return dh, dw, db


def _fused_bwd(st, res, cts):
  dh, dw, db = scaled(res, jnp.asarray(cts[0], jnp.float32), st.hidden_dtype, st.bias_dtype)
  # No gradient to the temperature, the ids, the mask or the objective's operands; the
  # metrics (aux, logp, entropy) carry none.
  return dh, dw, db, None, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def linear_objective(hidden: jax.Array, weight: jax.Array, targets: jax.Array,
                     objective: Callable, operands: Any = None, *, cfg: Any = None,
                     entropy_grad: bool = True, bias: jax.Array | None = None,
                     temperature: float | jax.Array = 1.0, mask: jax.Array | None = None,
                     weight_layout: str = "hv", fp32_head: bool = False,
                     implementation: str | None = None, config: BackwardConfig | None = None,
                     token_grad: Callable | None = None, token_operands: Any = None):
  """``objective(logp, entropy)`` of an LM head, with the head's gradient formed in the forward.

  Args:
    hidden, weight, targets, bias, temperature, mask, weight_layout, fp32_head,
      implementation, config: as in :func:`~jaxrl_kernels.linear_logp.linear_logp`
      (``"xla"`` is not offered: it has no backward kernels of its own).
    objective: ``objective(logp, entropy, operands, cfg) -> (loss, aux)``: ``logp`` and
      ``entropy`` float32 of ``targets.shape``, a float32 scalar ``loss`` and a pytree
      ``aux`` of metrics. A module-level function (it is part of the ``custom_vjp``'s
      static arguments, so it must be hashable and the same object from call to call).
    operands: a pytree of arrays the objective reads (advantages, old log-probs, ...); no
      gradient flows to them.
    cfg: hashable static configuration passed to ``objective``.
    entropy_grad: the loss depends on the entropy (False: the backward kernels may leave
      the entropy's term out; the gradient of a loss that does read it is then wrong).
    token_grad: for a token-level objective, ``token_grad(logp, entropy, token_operands,
      cfg) -> (g_logp, g_ent)``: the objective's gradient w.r.t. each token's ``logp`` and
      ``entropy`` (float32 ``[n]`` each, for ``n`` tokens and ``token_operands`` sliced to
      them), a function of each token's own values. A module-level function (a static
      argument). With ``config=BackwardConfig(passes=3)`` the head runs three GEMMs
      (the module docstring); otherwise it is unused. Its values must be the gradient of
      ``objective``: the loss comes from ``objective``, the head's gradients from it.
    token_operands: a pytree of arrays of ``targets.shape`` (per token) or scalars, the
      values ``token_grad`` reads (no gradient flows to them).

  Returns:
    ``(loss, aux, logp, entropy)``: the float32 scalar loss (differentiable w.r.t.
    ``hidden``, ``weight`` and ``bias``), and the objective's ``aux``, ``logp`` and
    ``entropy`` as metrics (no gradient).
  """
  x = api.validate(_OP, hidden, weight, targets, bias=bias, mask=mask, temperature=temperature,
                   weight_layout=weight_layout, fp32_head=fp32_head, return_entropy=True)
  _validation.check_bool(_OP, "entropy_grad", entropy_grad)
  if not callable(objective):
    raise TypeError(f"{_OP}: objective must be a function (logp, entropy, operands, cfg) -> "
                    f"(loss, aux), got {objective!r}")
  if config is not None and not isinstance(config, BackwardConfig):
    raise TypeError(f"{_OP}: config must be a BackwardConfig or None, got {config!r}")
  if token_grad is not None and not callable(token_grad):
    raise TypeError(f"{_OP}: token_grad must be a function (logp, entropy, token_operands, "
                    f"cfg) -> (g_logp, g_ent) or None, got {token_grad!r}")
  impl = api.resolve(_OP, implementation, x.compute_dtype,
                     supported=api.PARTIAL_IMPLEMENTATIONS)
  lead, t, h2, t2, m2 = api.rows(_OP, x)
  h2, w = api.with_features(api.zero_masked_rows(h2, m2), x.weight, weight_layout)
  head = api._Static(weight_layout, x.compute_dtype.name, impl, x.vocab_size, config, True)
  three = config is not None and config.passes == 3 and token_grad is not None
  st = _Static(head, objective, cfg, bool(entropy_grad), tuple(lead), h2.dtype.name,
               None if x.bias is None else x.bias.dtype.name,
               token_grad if three else None,
               (config.token_chunk if three and config.token_chunk
                else three_gemm.DEFAULT_TOKEN_CHUNK))
  token_ops = _per_token(token_operands, tuple(lead), t) if three else None
  if t:
    loss, aux, logp, ent = _fused(h2, w, x.bias, api._temperature_arg(x.temperature), t2, m2,
                                  (operands, token_ops), st)
  else:
    logp = ent = jnp.zeros((0,), jnp.float32)
    loss, aux = objective(logp.reshape(lead), ent.reshape(lead), operands, cfg)
    loss = _scalar(loss)
  logp = lax.stop_gradient(logp.reshape(lead))
  ent = lax.stop_gradient(ent.reshape(lead))
  return loss, lax.stop_gradient(aux), logp, ent


def _per_token(token_operands, lead: tuple[int, ...], t: int):
  """``token_operands`` with each per-token leaf flattened to ``[T]`` (scalars kept)."""
  def flat(x):
    x = jnp.asarray(x)
    if x.shape == lead:
      return x.reshape(t)
    if x.shape == ():
      return x
    raise ValueError(f"{_OP}: token_operands leaves must have the shape of targets {lead} "
                     f"or be scalars, got {x.shape}")

  return jax.tree.map(flat, token_operands)
