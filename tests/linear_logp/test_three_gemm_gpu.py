"""The three-GEMM fused objective on the GPU kernels (``"triton"``, ``"mosaic"`` on Hopper):
``logp``/``entropy`` bitwise ``linear_logp``'s and the four-GEMM path's, gradients the
four-GEMM path's to rounding, dH rows invariant to the batch and the token chunk, dW the
same for every token chunk and run to run. Weights are jit arguments (never closure
constants). Not run on the CPU: record the results of a GPU run here."""

import jax
import numpy as np
import pytest
from helpers import assert_bitwise_equal, rel_err
from test_objective import _inputs

import jaxrl_kernels as jk
from jaxrl_kernels import rl
from jaxrl_kernels.linear_logp import BackwardConfig

pytestmark = pytest.mark.gpu


def _grads(d, impl, config, weight):
  kw = dict(ref_logp=d["ref"], beta=0.04, entropy_coef=0.01, denominator=128.0)

  def f(hidden, weight):
    return rl.linear_policy_loss(hidden, weight, d["targets"], old_logp=d["old"],
                                 advantages=d["adv"], mask=d["mask"], temperature=0.7,
                                 implementation=impl, config=config, **kw)

  return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(d["hidden"], weight)


def _case(impl, dtype, v):
  d = _inputs(dtype, seed=7, b=2, t=600, h=256, v=v)
  three = BackwardConfig(passes=3)
  (l3, m3), g3 = _grads(d, impl, three, d["weight"])
  (l4, m4), g4 = _grads(d, impl, None, d["weight"])
  lp, ent = jk.linear_logp(d["hidden"], d["weight"], d["targets"], mask=d["mask"],
                           temperature=0.7, return_entropy=True, implementation=impl)
  assert_bitwise_equal(m3["logp"], lp, "logp vs linear_logp")
  assert_bitwise_equal(m3["entropy"], ent, "entropy vs linear_logp")
  assert_bitwise_equal(m3["logp"], m4["logp"], "logp, three vs four GEMMs")
  assert abs(float(l3) - float(l4)) <= 1e-6 * max(1.0, abs(float(l4)))
  grad_tol = 1e-6 if dtype == "float32" else 8e-3
  for name, a, b in zip(("dhidden", "dweight"), g3, g4):
    assert rel_err(a, np.asarray(b, np.float64)) <= grad_tol, name
  # The token chunk changes no bit of dH or dW; dW is the same run to run.
  (_, _), g512 = _grads(d, impl, BackwardConfig(passes=3, token_chunk=512), d["weight"])
  assert_bitwise_equal(g512[0], g3[0], "dH at token chunk 512 vs 256")
  assert_bitwise_equal(g512[1], g3[1], "dW at token chunk 512 vs 256")
  (_, _), g_again = _grads(d, impl, three, d["weight"])
  assert_bitwise_equal(g_again[1], g3[1], "dW run to run")
  # dH rows of the first sequence alone: the batch's rows.
  one = jax.tree.map(lambda x: x[:1] if getattr(x, "ndim", 0) and x.shape[0] == 2 else x, d)
  (_, _), g_one = _grads(one, impl, three, d["weight"])
  assert_bitwise_equal(g_one[0], g3[0][:1], "dH rows, batch of 1 vs 2")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_three_gemm_bits(dtype):
  _case("triton", dtype, 2000)


@pytest.mark.hopper
@pytest.mark.parametrize("v", [2000, 2048])  # 2048: dW accumulated in the GEMM's epilogue
def test_mosaic_three_gemm_bits(v):
  _case("mosaic", "bfloat16", v)
