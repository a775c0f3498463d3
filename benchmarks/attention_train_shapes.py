"""Attention fwd+bwd at the training step's document slots: ours vs cuDNN.

The shapes ``benchmarks/train_step.py`` gives the attention: its packed batch (seed 0,
rows of 4096 tokens) cut into documents, each left-aligned in a 4096-key slot, queries
past a document's length at position -1. One layer's forward + ``jax.vjp`` backward in one
jit, CUPTI device time (median). Rows: cuDNN (``jax.nn.dot_product_attention``, the stock
model's call), then ours with the Triton backward and with the Mosaic backward
(``attention_mosaic_bwd.BACKWARD_HEAD_DIMS`` widened for that row only, the traces of the
other route dropped, and the two rows' dK checked to differ; the forward is the Mosaic
kernel in both).

    PYTHONPATH=$PWD python benchmarks/attention_train_shapes.py
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import device_ms  # noqa: E402
from train_step import packed_batch  # noqa: E402

from jaxrl_kernels.attention import causal_attention  # noqa: E402
from jaxrl_kernels.models import decoder  # noqa: E402
from jaxrl_kernels.pallas import attention_mosaic_bwd  # noqa: E402

# (name, query heads, kv heads, tokens); D = 64, the rows of 4096 tokens.
SHAPES = (("qwen2.5-0.5b", 14, 2, 8192), ("llama-3.2-1b", 32, 8, 8192),
          ("qwen2.5-0.5b", 14, 2, 16384))
ROW, D = 4096, 64


def document_lengths(tokens: int) -> list[int]:
  lengths = []
  for row in packed_batch(tokens, ROW, 1000)["positions"]:
    starts = list(np.flatnonzero(row == 0)) + [len(row)]
    lengths += [int((row[s:e] >= 0).sum()) for s, e in zip(starts[:-1], starts[1:])]
  return lengths


def fwd_bwd(kind: str, length, qpos):
  def f(q, k, v, d_out):
    if kind == "cudnn":
      def g(q, k, v):
        return decoder._stock_attention(q, k, v, length, causal=True, q_lengths=length)
    else:
      def g(q, k, v):
        return causal_attention(q, k, v, q_positions=qpos, kv_lengths=length)
    out, vjp = jax.vjp(g, q, k, v)
    return out, vjp(d_out)
  return jax.jit(f)


def main() -> int:
  print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; D = {D}, bf16")
  print("| shape | tokens | documents | cuDNN ms | Triton backward ms | Mosaic backward ms |")
  print("|---|---|---|---|---|---|")
  default_dims = attention_mosaic_bwd.BACKWARD_HEAD_DIMS
  for name, hq, hkv, tokens in SHAPES:
    lengths = document_lengths(tokens)
    n = len(lengths)
    length = jnp.asarray(lengths, jnp.int32)
    j = jnp.arange(ROW, dtype=jnp.int32)[None]
    qpos = jnp.where(j < length[:, None], j, -1)
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (n, ROW, hq, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (n, ROW, hkv, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (n, ROW, hkv, D), jnp.bfloat16)
    d_out = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
    ms = {"cudnn": device_ms(fwd_bwd("cudnn", length, qpos), q, k, v, d_out)}
    grads = {}
    for kind, dims in (("triton", ()), ("mosaic", (D,))):
      attention_mosaic_bwd.BACKWARD_HEAD_DIMS = dims
      # The routing table is read while tracing, and the library's kernel calls are jitted
      # once per shape (_backend.kernel_jit): drop the traces of the other route.
      jax.clear_caches()
      try:
        f = fwd_bwd(kind, length, qpos)
        grads[kind] = f(q, k, v, d_out)[1]
        ms[kind] = device_ms(f, q, k, v, d_out)
      finally:
        attention_mosaic_bwd.BACKWARD_HEAD_DIMS = default_dims
        jax.clear_caches()
    # The two backwards are different kernels: their dK bits differ (else a route was not
    # taken and the row would time one backward twice).
    if np.array_equal(np.asarray(grads["triton"][1]), np.asarray(grads["mosaic"][1])):
      raise RuntimeError(f"{name}: the Triton and Mosaic rows ran the same backward")
    c = ms["cudnn"]
    print(f"| {name} {hq}/{hkv} heads | {tokens} | {n} {lengths} | {c:.3f} | "
          f"{ms['triton']:.3f} ({ms['triton'] / c:.2f}x) | "
          f"{ms['mosaic']:.3f} ({ms['mosaic'] / c:.2f}x) |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
