"""``BackwardConfig``: the free knobs of ``linear_logp``'s backward, as an argument.

Carried in the op's ``custom_vjp`` static arguments, so it is part of the jit
cache key. No field changes a row's bits of dH (each is tested); dW and db stay
deterministic run to run whatever the values.
"""

from __future__ import annotations

import dataclasses

from jaxrl_kernels import contract

KERNELS = ("gemm", "fused")
PASSES = (3, 4)


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """How an implementation runs the backward; ``None`` fields take its defaults.

  Attributes:
    kernel: ``"gemm"`` (three ``det_matmul`` products per vocab chunk with the
      logit gradient between them, :mod:`jaxrl_kernels.linear_logp.gemm_backward`;
      the ``"mosaic"`` default) or ``"fused"`` (the Triton kernels that recompute
      logit tiles, :mod:`jaxrl_kernels.pallas.linear_logp_bwd`; the default of
      ``"triton"`` and ``"interpret"``). Either runs the implementation's own
      kernels: ``"mosaic"`` with ``"fused"`` runs the Triton tile kernels (the
      Mosaic forward's Hopper companion), ``"triton"`` with ``"gemm"`` the
      Triton GEMM. Ignored by ``"cpu"`` and ``"xla"``, which have one backward.
    chunk: vocab columns per step of the chunk loop (a multiple of
      ``VOCAB_TILE``); bounds the ``[T, chunk]`` buffers.
    dh_rows: ``"gemm"`` only: token rows per dH product when the product is
      not accumulated in the GEMM's epilogue.
    accumulate: ``"gemm"`` on Mosaic: add the dH product in the dH GEMM's
      epilogue, in place.
    fuse_dz: ``"gemm"`` on Mosaic: compute the logit gradient in the logits
      GEMM's epilogue.
    passes: ``linear_objective`` (``rl.linear_policy_loss``) only: ``4`` (None, the
      default) runs the head's forward kernels and then its backward (the logits GEMM
      twice); ``3`` runs the three-GEMM path where the objective gives per-token
      cotangents (``token_grad``): per token chunk, the logits once, their statistics,
      the cotangents, dz, dH and dW (:mod:`jaxrl_kernels.linear_logp.three_gemm`).
      Other objectives (GSPO) run the four-GEMM path. ``linear_logp`` ignores it (its
      cotangents arrive after its forward).
    token_chunk: ``passes=3``: tokens per chunk, a multiple of
      ``contract.OBJECTIVE_DW_TOKEN_BLOCK`` (None: that block, 256); bounds the float32
      ``[token_chunk, V]`` logits and the ``[token_chunk, V]`` dz. Changes no bit.
  """

  kernel: str | None = None
  chunk: int | None = None
  dh_rows: int = 8192
  accumulate: bool = True
  fuse_dz: bool = True
  passes: int | None = None
  token_chunk: int | None = None

  def __post_init__(self):
    if self.kernel is not None and self.kernel not in KERNELS:
      raise ValueError(f"BackwardConfig: kernel must be one of {KERNELS} or None, got "
                       f"{self.kernel!r}")
    for name in ("chunk", "dh_rows", "token_chunk"):
      value = getattr(self, name)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"BackwardConfig: {name} must be a positive int, got {value!r}")
    if self.chunk is not None and self.chunk % contract.VOCAB_TILE:
      raise ValueError(f"BackwardConfig: chunk must be a multiple of VOCAB_TILE="
                       f"{contract.VOCAB_TILE}, got {self.chunk}")
    if self.passes is not None and (isinstance(self.passes, bool)
                                    or self.passes not in PASSES):
      raise ValueError(f"BackwardConfig: passes must be one of {PASSES} or None, got "
                       f"{self.passes!r}")
    if self.token_chunk is not None and self.token_chunk % contract.OBJECTIVE_DW_TOKEN_BLOCK:
      raise ValueError(f"BackwardConfig: token_chunk must be a multiple of "
                       f"OBJECTIVE_DW_TOKEN_BLOCK={contract.OBJECTIVE_DW_TOKEN_BLOCK}, got "
                       f"{self.token_chunk}")
    for name in ("accumulate", "fuse_dz"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"BackwardConfig: {name} must be a bool, got {getattr(self, name)!r}")
