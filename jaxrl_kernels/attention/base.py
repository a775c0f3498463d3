"""What every ``causal_attention`` backend provides (the dispatch table in ``api.py``).

A backend's ``forward(q, k, v, q_positions, kv_lengths, *, scale)`` returns the
output ``[B, Tq, Hq, D]`` and the base-2 logsumexp ``[B, Hq, Tq]`` (the
residual its ``backward`` takes); ``backward(q, k, v, q_positions, kv_lengths,
out, lse2, d_out, *, scale, every_row_sees_a_key=False)`` returns ``(dq, dk, dv)``.
``every_row_sees_a_key=True`` is ``causal_attention``'s promise that no query row is
padding (its default positions and lengths with ``Tq <= S``): a backend that clears
padding rows before its kernels (the Mosaic dK/dV) may skip that pass; the gradients'
bits are the same either way. ``supported(d, dtype)``
decides by head dim and dtype only (static, equal for a model's decode and
prefill), never by ``B``, ``Tq`` or ``S``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
  """One implementation of ``causal_attention``'s kernels.

  Attributes:
    name: the ``implementation=`` name.
    forward: ``(q, k, v, q_positions, kv_lengths, *, scale) -> (out, lse2)``.
    backward: ``(q, k, v, q_positions, kv_lengths, out, lse2, d_out, *, scale,
      every_row_sees_a_key=False) -> (dq, dk, dv)``.
    supported: ``(d, dtype) -> None`` or the reason this backend cannot run it.
    forward_heads_major: ``forward`` with ``q`` and the output as ``[B, Hq, Tq, D]`` (a
      decode step's query heads reach the kernel with no copy), or None where the backend
      has no such layout.
  """

  name: str
  forward: Callable
  backward: Callable
  supported: Callable
  forward_heads_major: Callable | None = None
