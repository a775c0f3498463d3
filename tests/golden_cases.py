"""Golden cases: each op x implementation x dtype on fixed inputs, reduced to digests.

A digest is ``sha256`` of the output's raw bytes, with its shape and dtype: any change of a
single bit of any output (forward or gradient) changes it. ``tests/test_golden.py`` compares
them with ``tests/golden_digests.json``; ``tests/golden_update.py`` rewrites that file for the
implementations the current machine runs (on a GPU: ``"mosaic"`` and ``"triton"``).

Inputs come from ``numpy`` generators with fixed seeds at small shapes that are no tile
multiple where the op allows, with rows scaled by ``2**±8`` so that a change of reduction
order shows in the bits.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxrl_kernels as jk
from jaxrl_kernels import models
from jaxrl_kernels.grouped_gemm import group_layout
from jaxrl_kernels.linear_logp import BackwardConfig
from jaxrl_kernels.nn.norm import rms_norm

CPU_IMPLEMENTATIONS = ("cpu", "interpret")
GPU_IMPLEMENTATIONS = ("mosaic", "triton")
DTYPES = ("float32", "bfloat16")


def _wide(rng, shape, dtype):
  x = rng.standard_normal(shape).astype(np.float32)
  scale = 2.0 ** rng.integers(-8, 9, size=shape[:-1] + (1,)).astype(np.float32)
  return jnp.asarray(x * scale, dtype)


def _plain(rng, shape, dtype, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale, dtype)


def digest(x) -> str:
  a = np.asarray(x)
  return f"{a.dtype}{list(a.shape)}:" + hashlib.sha256(a.tobytes()).hexdigest()[:32]


def _grads(fn, *args):
  """``fn(*args)`` and its gradients with respect to every argument, for a fixed cotangent
  (a float32 sum of the output times a fixed pattern)."""
  out = fn(*args)
  pattern = jnp.asarray(np.random.default_rng(99).standard_normal(out.shape), jnp.float32)
  grads = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * pattern),
                   argnums=tuple(range(len(args))))(*args)
  return out, grads


def det_matmul(impl, dtype):
  rng = np.random.default_rng(1)
  a, b = _wide(rng, (37, 128), dtype), _plain(rng, (128, 192), dtype, 0.1)
  out, (da, db) = _grads(jax.jit(lambda a, b: jk.det_matmul(a, b, implementation=impl)), a, b)
  return {"out": out, "da": da, "db": db}


def row_parallel_matmul(impl, dtype):
  rng = np.random.default_rng(2)
  x, w = _wide(rng, (21, 512), dtype), _plain(rng, (512, 128), dtype, 0.05)
  out, (dx, dw) = _grads(jax.jit(lambda x, w: jk.row_parallel_matmul(x, w, implementation=impl)),
                         x, w)
  return {"out": out, "dx": dx, "dw": dw}


def linear_logp(impl, dtype):
  rng = np.random.default_rng(3)
  h, w = _wide(rng, (45, 128), dtype), _plain(rng, (128, 640), dtype, 0.05)
  t = jnp.asarray(rng.integers(0, 640, 45), jnp.int32)

  def f(h, w):
    logp, ent = jk.linear_logp(h, w, t, return_entropy=True, temperature=0.7,
                               implementation=impl)
    return logp + 0.5 * ent

  logp, ent = jax.jit(lambda h, w: jk.linear_logp(h, w, t, return_entropy=True,
                                                    temperature=0.7, implementation=impl))(h, w)
  dh, dw = jax.jit(jax.grad(lambda h, w: jnp.sum(f(h, w)), argnums=(0, 1)))(h, w)
  return {"logp": logp, "entropy": ent, "dh": dh, "dw": dw}


def causal_attention(impl, dtype):
  rng = np.random.default_rng(4)
  q = _plain(rng, (2, 70, 4, 64), dtype)
  k = _plain(rng, (2, 70, 2, 64), dtype)
  v = _plain(rng, (2, 70, 2, 64), dtype)
  lengths = jnp.asarray([70, 53], jnp.int32)
  fn = jax.jit(lambda q, k, v: jk.causal_attention(q, k, v, kv_lengths=lengths,
                                                   implementation=impl))
  out, (dq, dk, dv) = _grads(fn, q, k, v)
  return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def reduce(impl, dtype):
  rng = np.random.default_rng(5)
  x = _wide(rng, (6, 333), dtype)
  return {"sum": jax.jit(lambda x: jk.det_sum(x, axis=-1, implementation=impl))(x),
          "cumsum": jax.jit(lambda x: jk.det_cumsum(x, axis=-1, implementation=impl))(x)}


def rms_norm_case(impl, dtype):
  rng = np.random.default_rng(6)
  x, w = _wide(rng, (19, 200), dtype), _plain(rng, (200,), jnp.float32)
  out, (dx, dw) = _grads(jax.jit(lambda x, w: rms_norm(x, w, eps=1e-6, implementation=impl)),
                         x, w)
  return {"out": out, "dx": dx, "dw": dw}


def decoder_logp(impl, dtype):
  cfg = models.config("qwen2.5-0.5b", num_hidden_layers=1, vocab_size=384, hidden_size=128,
                      intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=64, tie_word_embeddings=False)
  model = models.DecoderLM(cfg, dtype=dtype, param_dtype=dtype, implementation=impl,
                           rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(7)
  # Parameters drawn here, not by JAX's initializers, so the digest pins the kernels alone.
  state = jax.tree.map(lambda p: _plain(rng, p.shape, p.dtype, 0.08)
                       if jnp.issubdtype(p.dtype, jnp.floating) else p, state)
  model = nnx.merge(graphdef, state)
  tokens = jnp.asarray(rng.integers(0, 384, (2, 29)), jnp.int32)
  targets = jnp.roll(tokens, -1, axis=1)
  logp, ent = nnx.jit(lambda m, t, y: m.logp(t, y, return_entropy=True))(model, tokens, targets)
  return {"logp": logp, "entropy": ent}


def rl_objective(impl, dtype):
  del impl  # pure XLA element-wise maths and the fixed-order masked sums
  rng = np.random.default_rng(8)
  logp = jnp.asarray(rng.standard_normal((4, 33)) * 0.5 - 2, jnp.float32)
  old = logp + jnp.asarray(rng.standard_normal((4, 33)) * 0.2, jnp.float32)
  mask = jnp.asarray(np.arange(33)[None] < rng.integers(1, 34, (4, 1)))
  rewards = jnp.asarray(rng.standard_normal(4), jnp.float32)

  def loss(logp):
    return jk.rl.grpo_loss(logp, old, rewards, 2, mask=mask, ref_logp=old, beta=0.04)[0]

  value, grad = jax.jit(jax.value_and_grad(loss))(logp.astype(dtype).astype(jnp.float32))
  return {"loss": value, "dlogp": grad}


def linear_policy_loss(impl, dtype, config=None):
  """The policy loss fused into the head: loss, per-token logp/entropy, dH, dW."""
  rng = np.random.default_rng(10)
  h, w = _wide(rng, (2, 23, 128), dtype), _plain(rng, (128, 640), dtype, 0.05)
  t = jnp.asarray(rng.integers(0, 640, (2, 23)), jnp.int32)
  mask = jnp.asarray(np.arange(23)[None] < np.array([[23], [17]]))
  old = jnp.asarray(rng.standard_normal((2, 23)) * 0.5 - 6, jnp.float32)
  adv = jnp.asarray([0.7, -1.3], jnp.float32)

  def f(h, w):
    return jk.rl.linear_policy_loss(h, w, t, old_logp=old, advantages=adv, mask=mask,
                                    ref_logp=old, beta=0.04, entropy_coef=0.01,
                                    temperature=0.7, implementation=impl, config=config)

  (loss, m), (dh, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)
  return {"loss": loss, "logp": m["logp"], "entropy": m["entropy"], "dh": dh, "dw": dw}


def linear_policy_loss_3gemm(impl, dtype):
  """The same loss on the three-GEMM head (``BackwardConfig(passes=3)``): its logp and
  entropy digests equal ``linear_policy_loss``'s; dH and dW are its own bits (dH one product
  over the vocabulary, dW in ``OBJECTIVE_DW_TOKEN_BLOCK`` token blocks)."""
  return linear_policy_loss(impl, dtype, BackwardConfig(passes=3))


def grouped_matmul(impl, dtype):
  """150 assignments over 5 experts (one group across two row tiles, contract
  GROUPED_GEMM_BLOCK_M), K and N no tile multiple: out, dlhs, dw."""
  rng = np.random.default_rng(10)
  ids = np.sort(rng.integers(0, 5, 150))
  ids[:70] = 1
  lay = group_layout(jnp.asarray(ids, jnp.int32), 5)
  x = _wide(rng, (150, 96), dtype)
  xp = jnp.zeros((lay.rows, 96), x.dtype).at[lay.dest].set(x)
  w = _plain(rng, (5, 96, 200), dtype, 0.1)
  out, (dx, dw) = _grads(jax.jit(lambda x, w: jk.grouped_gemm.grouped_matmul(
      x, w, lay, implementation=impl)), xp, w)
  return {"out": out, "dx": dx, "dw": dw}


def moe_layer(impl, dtype):
  """The MoE layer: routing, dispatch, grouped GEMMs, combine; output and gradients."""
  rng = np.random.default_rng(11)
  x = _wide(rng, (70, 64), dtype)
  router = _plain(rng, (64, 8), dtype, 0.3)
  gate_up, down = _plain(rng, (8, 64, 96), dtype, 0.1), _plain(rng, (8, 48, 64), dtype, 0.1)

  def f(x, router, gate_up, down):
    return jk.moe.moe_mlp(x, router, gate_up, down, k=2, normalize=True,
                          implementation=impl).y

  out, (dx, dr, dgu, dd) = _grads(jax.jit(f), x, router, gate_up, down)
  return {"y": out, "dx": dx, "drouter": dr, "dgate_up": dgu, "ddown": dd}


def cpu_tiles(impl, dtype):
  """Shapes across the CPU implementation's row, column and vocab blocks (contract.CPU_*):
  300 rows and columns (CPU_ROW_BLOCK, CPU_COL_BLOCK = 128), 1500 vocab columns
  (CPU_VOCAB_CHUNK = 1024), 300 keys (CPU_ATTENTION_KEY_TILE = 128)."""
  rng = np.random.default_rng(9)
  a, b = _wide(rng, (300, 96), dtype), _plain(rng, (96, 300), dtype, 0.1)
  h, w = _wide(rng, (150, 64), dtype), _plain(rng, (64, 1500), dtype, 0.05)
  t = jnp.asarray(rng.integers(0, 1500, 150), jnp.int32)
  q = _plain(rng, (1, 300, 2, 32), dtype)
  kv = _plain(rng, (1, 300, 1, 32), dtype)
  return {"det_matmul": jax.jit(lambda a, b: jk.det_matmul(a, b, implementation=impl))(a, b),
          "linear_logp": jax.jit(lambda h, w: jk.linear_logp(h, w, t, implementation=impl))(h, w),
          "attention": jax.jit(lambda q, k: jk.causal_attention(q, k, k, implementation=impl))(
              q, kv)}


# op -> (function, implementations it has among CPU_ and GPU_IMPLEMENTATIONS, dtypes per
# implementation). Mosaic runs 16-bit inputs only; rl has no implementation argument.
CASES = {
    "det_matmul": (det_matmul, ("cpu", "interpret", "triton", "mosaic")),
    "row_parallel_matmul": (row_parallel_matmul, ("cpu", "interpret", "triton", "mosaic")),
    "linear_logp": (linear_logp, ("cpu", "interpret", "triton", "mosaic")),
    "causal_attention": (causal_attention, ("cpu", "interpret", "triton", "mosaic")),
    "reduce": (reduce, ("cpu", "interpret", "triton")),
    "rms_norm": (rms_norm_case, ("cpu", "interpret", "triton")),
    "decoder_logp": (decoder_logp, ("cpu", "interpret", "triton", "mosaic")),
    "rl": (rl_objective, ("cpu",)),
    "linear_policy_loss": (linear_policy_loss, ("cpu", "interpret", "triton", "mosaic")),
    "linear_policy_loss_3gemm": (linear_policy_loss_3gemm,
                                 ("cpu", "interpret", "triton", "mosaic")),
    "cpu_tiles": (cpu_tiles, ("cpu", "interpret")),
    "grouped_matmul": (grouped_matmul, ("cpu", "interpret", "triton")),
    "moe_mlp": (moe_layer, ("cpu", "interpret", "triton")),
}


def keys(implementations) -> list[tuple[str, str, str]]:
  """``(op, implementation, dtype)`` of every golden case among ``implementations``."""
  out = []
  for op, (_, impls) in CASES.items():
    for impl in impls:
      if impl not in implementations:
        continue
      for dtype in DTYPES:
        if impl == "mosaic" and dtype == "float32":
          continue
        out.append((op, impl, dtype))
  return out


def key_name(op: str, impl: str, dtype: str) -> str:
  return f"{op}/{impl}/{dtype}"


def compute(op: str, impl: str, dtype: str) -> dict[str, str]:
  fn, _ = CASES[op]
  return {name: digest(x) for name, x in fn(impl, dtype).items()}
