"""What every ``det_matmul`` backend provides (the dispatch table in ``api.py`` holds them).

A backend computes one 2-D product ``op(lhs) @ op(rhs)``:

* ``lhs`` ``[M, K]``, or ``[K, M]`` with ``lhs_transposed`` (the dB product,
  a reduction over tokens);
* ``rhs`` ``[K, N]``, or ``[N, K]`` with ``rhs_transposed`` (read in place);
* result ``[M, N]`` in ``out_dtype``, accumulated in float32 over K in the
  contract's fixed K tiles (``jaxrl_kernels/contract.py``), ascending.

Its ``supported(n, k, dtype)`` decides by the weight's N and K and the dtype
only, never by M, so a weight runs the same kernel at every batch size. The
same backend runs the forward and both backward products.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

MatmulFn = Callable[..., jax.Array]
SupportFn = Callable[[int, int, object], "str | None"]


def always_supported(n: int, k: int, dtype) -> str | None:
  """The support check of a backend that runs every shape and dtype."""
  del n, k, dtype
  return None


@dataclasses.dataclass(frozen=True)
class GemmBackend:
  """One implementation of ``det_matmul``.

  Attributes:
    name: the ``implementation=`` name.
    matmul: ``matmul(lhs, rhs, *, lhs_transposed, rhs_transposed, out_dtype)``.
    supported: ``supported(n, k, dtype)``: None when the backend runs a
      ``[K, N]`` weight of ``dtype``, else the reason it cannot.
    batch_invariant: whether rows of the forward product are bitwise invariant
      (False only for the ``"xla"`` baseline).
  """

  name: str
  matmul: MatmulFn
  supported: SupportFn = always_supported
  batch_invariant: bool = True
