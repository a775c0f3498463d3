"""``LMHead``: the LM-head parameters, read by the fused log-prob op and by a sampler.

The module holds parameters; the op does the work (``jaxrl_kernels.linear_logp``):

* ``head(h, targets)``: selected-token log-probs (and entropy) through
  :func:`jaxrl_kernels.linear_logp`; the ``[..., V]`` logits never exist.
* ``head.logits(h)``: the float32 logits for a sampler, by
  :func:`~jaxrl_kernels.linear_logp.head_logits` (the fused op's own kernel
  with a store epilogue: every logit has the bits of the fused path's).
* ``head.logits(h, return_stats=True)`` then :func:`logp_from_stats`: **the
  bitwise sampler path** (logp and entropy equal to the trainer's
  ``head(h, targets, return_entropy=True)`` on every implementation but ``"xla"``).
* ``head.logp_from_logits(logits, targets)``: :func:`logits_logp`, log-probs of
  logits given after the fact (bitwise under the interpreter; within a relative
  1e-6 compiled, see its docstring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_kernels.linear_logp import api as _api
from jaxrl_kernels.linear_logp import linear_logp
from jaxrl_kernels.linear_logp.logits import LogitPartials as LogitPartials
from jaxrl_kernels.linear_logp.logits import LogitStats as LogitStats
from jaxrl_kernels.linear_logp.logits import head_draw_partials as head_draw_partials
from jaxrl_kernels.linear_logp.logits import head_logits as head_logits
from jaxrl_kernels.linear_logp.logits import head_logits_partials as head_logits_partials
from jaxrl_kernels.linear_logp.logits import logits_logp as logits_logp
from jaxrl_kernels.linear_logp.logits import logp_from_stats as logp_from_stats
from jaxrl_kernels.linear_logp.logits import merge_logit_partials as merge_logit_partials

_DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()
_DEFAULT_BIAS_INIT = nnx.initializers.zeros_init()


class LMHead(nnx.Module):
  """An LM head ``z = h @ W (+ b)`` read without logits for training, with logits for sampling.

  Parameters: ``kernel [H, V]`` (as ``nnx.Linear``), or, with
  ``tied_embedding``, the ``[V, H]`` embedding variable itself (shared, read in
  place, never transposed or copied); optional ``bias [V]``.

  ``fp32_head=True`` computes the projection from float32-upcast tiles of
  ``h`` and ``W`` (``h`` is then used in its own dtype, e.g. a float32
  residual stream) while ``W`` stays in ``param_dtype``; gradients are
  accumulated in float32 and returned in the parameter's dtype (e.g. bf16).
  Otherwise ``h`` is cast to the weight's dtype.
  """

  def __init__(self, hidden: int, vocab: int, *, tied_embedding: nnx.Variable | None = None,
               use_bias: bool = False, fp32_head: bool = False, param_dtype=jnp.float32,
               kernel_init=_DEFAULT_KERNEL_INIT, bias_init=_DEFAULT_BIAS_INIT,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.hidden_size = hidden
    self.vocab_size = vocab
    self.fp32_head = fp32_head
    self.implementation = implementation
    if tied_embedding is not None:
      shape = tuple(tied_embedding.get_value().shape)
      if shape != (vocab, hidden):
        raise ValueError(f"LMHead: tied_embedding must be [vocab, hidden] = {(vocab, hidden)}, "
                         f"got {shape}")
      self.embedding = tied_embedding  # the same variable: one parameter, two readers
      self.kernel = None
    else:
      self.embedding = None
      self.kernel = nnx.Param(kernel_init(rngs.params(), (hidden, vocab), param_dtype))
    dtype = self.weight().dtype
    self.bias = nnx.Param(bias_init(rngs.params(), (vocab,), dtype)) if use_bias else None

  @property
  def weight_layout(self) -> str:
    return "vh" if self.embedding is not None else "hv"

  @property
  def compute_dtype(self):
    return jnp.dtype(jnp.float32 if self.fp32_head else self.weight().dtype)

  def weight(self) -> jax.Array:
    """The ``[H, V]`` kernel, or the tied ``[V, H]`` embedding (see :attr:`weight_layout`)."""
    return (self.embedding if self.embedding is not None else self.kernel).get_value()

  def hidden(self, h: jax.Array) -> jax.Array:
    """``h`` as the head reads it: cast to the weight's dtype unless ``fp32_head``."""
    h = jnp.asarray(h)
    return h if self.fp32_head else h.astype(self.weight().dtype)

  def bias_value(self) -> jax.Array | None:
    """The ``[V]`` bias, or None."""
    return None if self.bias is None else self.bias.get_value()

  def __call__(self, h: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
               temperature: float = 1.0, return_entropy: bool = False):
    """``[..., H]`` hidden states -> float32 ``logp [...]`` (and entropy) of ``targets``."""
    return linear_logp(self.hidden(h), self.weight(), targets, bias=self.bias_value(),
                       temperature=temperature, mask=mask, return_entropy=return_entropy,
                       weight_layout=self.weight_layout, fp32_head=self.fp32_head,
                       implementation=self.implementation)

  def policy_loss(self, h: jax.Array, targets: jax.Array, mask: jax.Array | None = None, *,
                  temperature: float = 1.0, **objective):
    """``[..., T, H]`` hidden states -> ``(loss, metrics)`` of
    :func:`jaxrl_kernels.rl.linear_policy_loss` (the policy loss fused into this head;
    ``objective``: its keyword arguments, ``old_logp`` and ``advantages`` at least).
    ``metrics["logp"]`` is bitwise ``self(h, targets, mask, temperature)``.

    ``implementation="xla"`` (the stock path, which has no fused objective) computes the
    unfused composition, :func:`~jaxrl_kernels.rl.policy_loss` of this head's ``logp`` and
    ``entropy``: the same loss and metrics to float rounding, so one training step serves
    both paths (``config``, the fused backward's, does not apply there)."""
    from jaxrl_kernels import rl  # noqa: PLC0415 - rl sits above the head's kernels

    if self.implementation == "xla":
      objective.pop("config", None)
      logp, entropy = self(h, targets, mask, temperature, return_entropy=True)
      loss, metrics = rl.policy_loss(logp, entropy=entropy, mask=mask, **objective)
      stop = jax.lax.stop_gradient
      return loss, {**metrics, "logp": stop(logp), "entropy": stop(entropy)}
    return rl.linear_policy_loss(self.hidden(h), self.weight(), targets, mask=mask,
                                 bias=self.bias_value(), temperature=temperature,
                                 weight_layout=self.weight_layout, fp32_head=self.fp32_head,
                                 implementation=self.implementation, **objective)

  def logits(self, h: jax.Array, temperature: float = 1.0, return_stats: bool = False):
    """``[..., H]`` -> float32 ``[..., V]`` logits, bitwise the fused path's projection
    (and, with ``return_stats``, :class:`LogitStats` whose entropy is bitwise
    ``self(h, t, ..., temperature, return_entropy=True)``'s and with which
    :func:`logp_from_stats` gives ``self(h, t, ..., temperature)`` bitwise)."""
    return head_logits(self.hidden(h), self.weight(), bias=self.bias_value(),
                       temperature=temperature, weight_layout=self.weight_layout,
                       fp32_head=self.fp32_head, return_stats=return_stats,
                       implementation=self.implementation)

  def logits_partials(self, h: jax.Array, temperature: float = 1.0):
    """``self.logits(h, temperature, return_stats=True)`` with the statistics' merge left
    to :meth:`merge_partials` (:func:`head_logits_partials`): ``(logits, LogitPartials)``.
    None for ``implementation="xla"`` (no per-tile statistics there)."""
    if self.implementation == "xla":
      return None
    return head_logits_partials(self.hidden(h), self.weight(), bias=self.bias_value(),
                                temperature=temperature, weight_layout=self.weight_layout,
                                fp32_head=self.fp32_head, implementation=self.implementation)

  def draw_partials(self, h: jax.Array, seed: jax.Array, temperature: float = 1.0):
    """A token per row drawn from ``softmax(self.logits(h, temperature))`` with its logit and
    the per-tile statistics of :meth:`logits_partials` (:func:`head_draw_partials`: on
    Hopper the draw runs in the head's kernel and no logits reach memory):
    ``(tokens, token_logits, LogitPartials)``. None for ``implementation="xla"``."""
    if self.implementation == "xla":
      return None
    return head_draw_partials(self.hidden(h), self.weight(), seed, bias=self.bias_value(),
                              temperature=temperature, weight_layout=self.weight_layout,
                              fp32_head=self.fp32_head, implementation=self.implementation)

  def merge_partials(self, partials: LogitPartials) -> LogitStats:
    """:class:`LogitStats` of :meth:`logits_partials`' statistics, of one call or of several
    calls' rows stacked after the tile axis: bitwise ``self.logits(..., return_stats=True)``'s
    statistics of each row."""
    impl = _api.resolve("merge_logit_partials", self.implementation, self.compute_dtype)
    return merge_logit_partials(partials, implementation=impl)

  def logp_from_logits(self, logits: jax.Array, targets: jax.Array,
                       mask: jax.Array | None = None, return_entropy: bool = False):
    """Log-probs of given logits (see :func:`logits_logp` for how close to ``self(h,
    targets, ..., temperature)`` they are on each implementation). For bitwise sampler
    log-probs use ``self.logits(h, T, return_stats=True)`` and :func:`logp_from_stats`."""
    impl = None if self.implementation == "xla" else self.implementation
    return logits_logp(logits, targets, mask=mask, return_entropy=return_entropy,
                       compute_dtype=self.compute_dtype, implementation=impl)
