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
    fallback: the implementation a default (``implementation=None``) call runs for a
      weight this backend does not take (``supported`` says why), by N, K and dtype only.

  What the row-parallel chunk plan (``gemm/row_parallel.py``) may ask of a backend; each
  choice gives the bits of the chunk products it replaces:
    vmaps_chunks: ``jax.vmap`` of ``matmul`` over a leading chunk axis runs each chunk as
      exactly the computation of one call on it (one launch for the C chunk products).
    shape_free: every output element's walk is fixed whatever the product's M, N or
      reduction rows, so per-chunk backward products may run as one product over all chunks.
    pads_k: runs K chunks that are not whole K tiles zero-padded to whole tiles (the zero
      terms add exactly 0).
    training_of_padded: the implementation whose unpadded chunk products a differentiated
      call runs for a padded plan (the same bits without the pad copies).
    grouped_matmul: ``grouped_matmul(lhs [M, C*Kc] or [C, M, Kc], rhs [C, Kc, N], *,
      out_dtype)``: the C chunk products in one launch.
    chunk_tree_matmul: ``chunk_tree_matmul(x, w, bias, *, chunks, out_dtype)``: the chunk
      products and their adjacent-pair tree in one launch (no float32 partials in memory).
    takes_whole: ``takes_whole(m, k, n)``: whether ``dx`` and ``dw`` of an unpadded
      ``[k, n]`` weight run on this backend as whole products.
    epilogues: its kernel (``pallas/gemm_mosaic.py``) takes the accumulate (``acc=``) and
      element-wise epilogues that the ``linear_logp`` backward fuses (bitwise the unfused
      form).
  """

  name: str
  matmul: MatmulFn
  supported: SupportFn = always_supported
  batch_invariant: bool = True
  fallback: str | None = None
  vmaps_chunks: bool = False
  shape_free: bool = False
  pads_k: bool = False
  training_of_padded: str | None = None
  grouped_matmul: MatmulFn | None = None
  chunk_tree_matmul: MatmulFn | None = None
  takes_whole: Callable[[int, int, int], bool] | None = None
  epilogues: bool = False
