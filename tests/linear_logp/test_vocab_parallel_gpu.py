"""Vocab-parallel linear_logp over two or more CUDA GPUs (Triton lowering): the real
``shard_map`` over NCCL gives the unsharded bits (the psum merge does not), and gradients.

TP emulated on one device (the shards' kernels one after another, merged as the TP op
merges them) is tests/test_contract.py, for every implementation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err, wide_rows
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_kernels.linear_logp import linear_logp
from jaxrl_kernels.linear_logp.vocab_parallel import pad_vocab, vocab_parallel_logp

pytestmark = pytest.mark.gpu

IMPL = "triton"
T, H, V = 1000, 1024, 32003


def _case(dtype=jnp.bfloat16, seed=0):
  x = wide_rows(jax.random.key(seed), T, H, dtype, spread=4)
  w = (jax.random.normal(jax.random.key(seed + 1), (H, V), jnp.float32) * (2.0 / np.sqrt(H)))
  tg = jax.random.randint(jax.random.key(seed + 2), (T,), 0, V)
  return x, w.astype(dtype), tg


def _need(n):
  if jax.device_count() < n:
    pytest.skip(f"needs {n} GPUs, this machine has {jax.device_count()}")
  return Mesh(np.asarray(jax.devices()[:n]), ("tp",))


@pytest.mark.parametrize("tp", [2, 4])
def test_multi_gpu_tp_bitwise_and_psum_control(tp):
  mesh = _need(tp)
  x, w, tg = _case(seed=3)
  ref_lp, ref_ent = linear_logp(x, w, tg, return_entropy=True, implementation=IMPL)
  run = functools.partial(vocab_parallel_logp, x, pad_vocab(w, tp), tg, mesh=mesh,
                          weight_spec=P(None, "tp"), vocab_size=V, return_entropy=True,
                          implementation=IMPL)
  lp, ent = jax.jit(run)()
  assert_bitwise_equal(lp, ref_lp, f"TP={tp} logp")
  assert_bitwise_equal(ent, ref_ent, f"TP={tp} entropy")
  plp, pent = jax.jit(functools.partial(run, merge="psum"))()
  assert rel_err(plp, ref_lp) < TOL["bfloat16"][0]
  assert np.any(bits(plp) != bits(ref_lp)) or np.any(bits(pent) != bits(ref_ent))


@pytest.mark.parametrize("tp", [2, 4])
def test_multi_gpu_gradients(tp):
  mesh = _need(tp)
  x, w, tg = _case(jnp.float32, seed=5)
  x, w = x[:256], w
  tg = tg[:256]

  def loss(fn, h, ww):
    lp, ent = fn(h, ww)
    return jnp.sum(lp) + 0.3 * jnp.sum(ent)

  ref = jax.grad(functools.partial(loss, lambda h, ww: linear_logp(
      h, ww, tg, return_entropy=True, implementation=IMPL)), argnums=(0, 1))(x, w)
  fn = lambda h, ww: vocab_parallel_logp(h, ww, tg, mesh=mesh, weight_spec=P(None, "tp"),
                                         vocab_size=V, return_entropy=True, implementation=IMPL)
  dh, dw = jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1)))(x, pad_vocab(w, tp))
  assert rel_err(dh, ref[0]) < TOL["float32"][1]
  assert rel_err(dw[:, :V], ref[1]) < TOL["float32"][1]
