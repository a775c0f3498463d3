"""``docs_per_step`` gradient accumulation: a training-step driver for optax.

One optimizer step consumes several micro-batches:

* ``docs_per_step = 0``: a fixed number (``micro_batches``) of micro-batches;
* ``docs_per_step > 0``: micro-batches are pulled one at a time and their
  documents counted (summed over data-parallel processes) until the global
  count reaches ``docs_per_step``; the micro-batch that crosses the target is
  kept (overshoot), so a step holds ``>= docs_per_step`` documents.

In both modes the step's total document count ``N`` is known before any
gradient is computed (the micro-batches are pulled first, their documents
counted on the host), and every micro-batch loss is divided by that same ``N``:

.. math::  g = \\sum_{k} \\nabla_\\theta \\frac{\\sum_{d \\in mb_k} \\ell_d}{N}
             = \\nabla_\\theta \\frac{\\sum_{d} \\ell_d}{N}

which is the gradient of one big batch holding all the micro-batches (up to
float32 rounding of the sum). Dividing each micro-batch by its own count
instead would weight documents by ``1 / (size of their micro-batch)``.

The loss function receives ``N`` as its divisor:

.. code-block:: python

   def loss_fn(params, batch, num_documents):
     logp = policy_logp(params, batch)                      # [B, T]
     loss, metrics = rl.grpo_loss(logp, batch["old_logp"], batch["rewards"], 8,
                                  mask=batch["mask"], token_level=False,
                                  denominator=num_documents)
     return loss

``count_documents(batch)`` tells the driver how many documents (the loss's
normalisation units) a micro-batch holds; for a token-level loss, count tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_kernels import _validation as val

Params = Any
Batch = Any
LossFn = Callable[[Params, Batch, jax.Array], Any]


class TrainState(NamedTuple):
  """Parameters, optimizer state, and host-side counters."""

  params: Params
  opt_state: optax.OptState
  step: int
  documents_seen: int


def _global_count(local: int) -> int:
  """Sums a host-side count over all processes (data-parallel hosts)."""
  if jax.process_count() == 1:  # one controller: the micro-batch is already global
    return int(local)
  from jax.experimental import multihost_utils
  return int(np.sum(multihost_utils.process_allgather(np.int64(local))))


def _document_count(n: Any) -> int:
  """``count_documents``'s answer as an int >= 0 (a 0-d integer array is fine; 2.5 is not)."""
  if isinstance(n, jax.Array | np.ndarray) and n.shape == () and val.is_concrete(n):
    if val.dtype_kind(n.dtype) in "iu":
      n = int(n)
  return val.check_int("Trainer.pull", "count_documents(batch)", n, minimum=0)


@dataclasses.dataclass
class Trainer:
  """Gradient accumulation over micro-batches with a step-total document divisor.

  Args:
    loss_fn: ``loss_fn(params, batch, num_documents) -> loss`` (or ``(loss, aux)``
      with ``has_aux``): the micro-batch's summed per-document losses divided by
      ``num_documents`` (a float32 scalar, the step total; traced, so changing it
      never recompiles).
    optimizer: an optax ``GradientTransformation``; updated once per step.
    count_documents: ``count_documents(batch) -> int``, on the host, for the
      micro-batch as the iterator yields it (this process's part of it).
    docs_per_step: ``0`` for a fixed number of micro-batches per step; ``> 0``
      for the dynamic document target.
    micro_batches: micro-batches per step when ``docs_per_step == 0``.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; aux leaves are summed over the
      step's micro-batches, so normalise them by ``num_documents`` like the loss.
    batch_sharding: a ``jax.sharding.Sharding`` (e.g.
      ``NamedSharding(mesh, P("data"))``) to place every micro-batch leaf with
      (leading axis split over the data axis); with a ``NamedSharding`` the
      parameters are replicated over its mesh by :meth:`init`. ``None``: the
      batches are used as given.

  The per-micro-batch gradient function is one ``jax.jit``, compiled once per
  micro-batch shape; gradients are accumulated in float32 (cast to the parameter
  dtype for the optimizer).
  """

  loss_fn: LossFn
  optimizer: optax.GradientTransformation
  count_documents: Callable[[Batch], int]
  docs_per_step: int = 0
  micro_batches: int = 1
  has_aux: bool = False
  batch_sharding: jax.sharding.Sharding | None = None

  def __post_init__(self):
    if not callable(self.loss_fn) or not callable(self.count_documents):
      raise TypeError("Trainer: loss_fn and count_documents must be callables")
    self.docs_per_step = val.check_int("Trainer", "docs_per_step", self.docs_per_step,
                                       minimum=0)
    self.micro_batches = val.check_int("Trainer", "micro_batches", self.micro_batches,
                                       minimum=1)
    self.has_aux = val.check_bool("Trainer", "has_aux", self.has_aux)
    if self.batch_sharding is not None and not isinstance(self.batch_sharding,
                                                          jax.sharding.Sharding):
      raise TypeError(f"Trainer: batch_sharding must be a jax.sharding.Sharding or None, got "
                      f"{type(self.batch_sharding).__name__}")
    self._accumulate = jax.jit(self._accumulate_impl, donate_argnums=1)
    self._zeros = jax.jit(lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p))
    self._update = jax.jit(self._update_impl)

  # -- jitted pieces -------------------------------------------------------------------------

  def _accumulate_impl(self, params, acc, batch, num_documents):
    out, grads = jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)(params, batch,
                                                                        num_documents)
    loss, aux = out if self.has_aux else (out, None)
    acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
    return acc, loss.astype(jnp.float32), aux

  def _update_impl(self, params, opt_state, grads):
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, opt_state = self.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # -- public API ----------------------------------------------------------------------------

  def init(self, params: Params) -> TrainState:
    """Initial state; replicates ``params`` over ``batch_sharding``'s mesh if any."""
    if isinstance(self.batch_sharding, jax.sharding.NamedSharding):
      replicated = jax.sharding.NamedSharding(self.batch_sharding.mesh,
                                              jax.sharding.PartitionSpec())
      params = jax.device_put(params, replicated)
    return TrainState(params, self.optimizer.init(params), 0, 0)

  def pull(self, batches: Iterator[Batch]) -> tuple[list[Batch], int]:
    """Pulls one step's micro-batches; returns them and the step's global document count.

    Stops after ``micro_batches`` micro-batches (``docs_per_step == 0``) or once the
    global count reaches ``docs_per_step`` (micro-batches without documents are
    taken and counted as 0). If the iterator ends first the step is partial; if it
    yields nothing, ``StopIteration`` is raised.
    """
    pulled, total = [], 0
    while (len(pulled) < self.micro_batches if self.docs_per_step == 0
           else total < self.docs_per_step):
      try:
        batch = next(batches)
      except StopIteration:
        break
      # Every process sees the same global total, so all stop at the same micro-batch.
      total += _global_count(_document_count(self.count_documents(batch)))
      pulled.append(batch)
    if not pulled:
      raise StopIteration("Trainer.pull: the batch iterator is exhausted")
    return pulled, total

  def _place(self, batch: Batch) -> Batch:
    if self.batch_sharding is None:
      return batch

    def put(x):
      if isinstance(x, jax.Array):
        return jax.device_put(x, self.batch_sharding)
      return jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x))

    return jax.tree.map(put, batch)

  def gradients(self, params: Params, micro_batches: list[Batch],
                num_documents: int) -> tuple[Params, jax.Array, Any]:
    """Sum over micro-batches of ``grad loss_fn(params, mb, num_documents)``.

    Returns ``(grads, loss, aux)``: float32 gradients, the summed loss (the step
    loss) and the summed aux (``None`` without ``has_aux``). ``num_documents`` of
    0 (no document at all) divides by 1.
    """
    num_documents = val.check_int("Trainer.gradients", "num_documents", num_documents,
                                  minimum=0)
    divisor = jnp.float32(max(num_documents, 1))
    acc = self._zeros(params)
    loss, aux = jnp.float32(0), None
    for mb in micro_batches:
      acc, mb_loss, mb_aux = self._accumulate(params, acc, self._place(mb), divisor)
      loss = loss + mb_loss
      aux = mb_aux if aux is None else jax.tree.map(jnp.add, aux, mb_aux)
    return acc, loss, aux

  def step(self, state: TrainState, batches: Iterator[Batch]) -> tuple[TrainState, dict]:
    """One optimizer step: pull micro-batches, accumulate gradients, update once.

    Returns the new state and metrics: ``loss`` (the step loss), ``num_documents``
    (this step), ``documents_seen`` (cumulative), ``num_micro_batches``, and the
    summed aux under ``"aux"`` with ``has_aux``.
    """
    micro_batches, num_documents = self.pull(batches)
    grads, loss, aux = self.gradients(state.params, micro_batches, num_documents)
    params, opt_state = self._update(state.params, state.opt_state, grads)
    seen = state.documents_seen + num_documents
    metrics = {"loss": loss, "num_documents": num_documents, "documents_seen": seen,
               "num_micro_batches": len(micro_batches)}
    if self.has_aux:
      metrics["aux"] = aux
    return TrainState(params, opt_state, state.step + 1, seen), metrics
