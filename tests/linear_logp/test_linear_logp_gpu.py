"""linear_logp's Triton kernels on a CUDA GPU at realistic shapes: what only this backend
has to prove.

Accuracy against float64 (bf16 and fp32 products, both weight layouts, the fp32 head that
Triton runs as 3xTF32) and the memory bound at the issue's shape (no ``[T, V]`` temporary).
Every invariance (batch with dH rows, position, padding, chunking, mode, run to run, vocab
shards) is tests/test_contract.py, at these shapes on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, rel_err

from jaxrl_kernels.linear_logp import linear_logp
from jaxrl_kernels.linear_logp.reference import linear_logp_reference

pytestmark = pytest.mark.gpu

IMPL = "triton"
H, V = 1024, 32003  # V not a multiple of the vocab tile


def _weight(dtype, layout, h=H, v=V, seed=1):
  w = jax.random.normal(jax.random.key(seed), (h, v), jnp.float32) * (2.0 / np.sqrt(h))
  return (w if layout == "hv" else w.T).astype(dtype)


@pytest.mark.parametrize("dtype,layout,fp32_head", [
    ("bfloat16", "hv", False), ("bfloat16", "vh", False), ("float32", "hv", False),
    ("bfloat16", "vh", True)])
def test_accuracy_vs_float64(dtype, layout, fp32_head):
  t = 513
  k = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(k[0], (t, H), jnp.float32).astype(dtype)
  w = _weight(dtype, layout)
  b = (jax.random.normal(k[1], (V,)) * 0.5).astype(dtype)
  tg = jax.random.randint(k[2], (t,), 0, V)
  mask = jax.random.bernoulli(k[3], 0.8, (t,))
  gl = jax.random.normal(k[4], (t,))

  def loss(x, w, b):
    lp, ent = linear_logp(x, w, tg, bias=b, mask=mask, temperature=0.8, return_entropy=True,
                          weight_layout=layout, fp32_head=fp32_head, implementation=IMPL)
    return jnp.sum(lp * gl) + 0.5 * jnp.sum(ent), (lp, ent)

  (_, (lp, ent)), (dx, dw, db) = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, b)
  ref = linear_logp_reference(x, w, tg, bias=b, mask=mask, temperature=0.8,
                              weight_layout=layout, g_logp=gl, g_ent=0.5 * np.ones(t))
  fwd_tol = TOL["float32"][0] if fp32_head else TOL[dtype][0]
  assert rel_err(lp, ref["logp"]) <= fwd_tol
  assert rel_err(ent, ref["entropy"]) <= fwd_tol
  small = np.abs(ref["logp"]) < 20
  assert np.max(np.abs(np.asarray(lp) - ref["logp"])[small]) <= 2e-2
  for got, key in ((dx, "dh"), (dw, "dw"), (db, "db")):
    assert rel_err(got, ref[key]) <= TOL[dtype][1], key


def test_temporaries_are_small_at_the_issue_shape():
  t, h, v = 8192, 4096, 151936
  spec = (jax.ShapeDtypeStruct((t, h), jnp.bfloat16), jax.ShapeDtypeStruct((h, v), jnp.bfloat16),
          jax.ShapeDtypeStruct((t,), jnp.int32))

  def temp(impl):
    def loss(a, w, tg):
      lp, ent = linear_logp(a, w, tg, return_entropy=True, implementation=impl)
      return jnp.sum(lp) + jnp.sum(ent)
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return fn.lower(*spec).compile().memory_analysis().temp_size_in_bytes

  fused, xla = temp(IMPL), temp("xla")
  # No [T, V] array: one float32 logits array alone is t * v * 4 bytes (4.6 GiB here), and
  # everything the fused op keeps is an order of magnitude below it. (The issue's 2%-of-XLA
  # target is a benchmark number: benchmarks/results/linear_logp.md.)
  logits = t * v * 4
  assert fused <= 0.1 * logits, (f"fused temporaries {fused / 2**20:.0f} MiB vs one [T, V] "
                                 f"float32 array {logits / 2**20:.0f} MiB")
  assert fused <= 0.05 * xla, f"fused temporaries {fused / 2**20:.0f} MiB vs XLA {xla / 2**20:.0f}"
