"""The three-GEMM fused objective (``BackwardConfig(passes=3)``, linear_logp/three_gemm.py).

Claims: ``logp`` and ``entropy`` are bitwise ``linear_logp``'s (and the four-GEMM path's);
the loss, metrics and gradients equal the four-GEMM path's and the unfused composition's to
float rounding, and the float64 truth within the contract's bounds; dH rows are bitwise
invariant to the batch, to padding and to the token chunk; dW is bitwise run to run and the
same for every token chunk, while a sum of the same products in chunk-sized groups (the
order a chunk-dependent accumulation would take) changes its bits; an objective without
per-token cotangents (GSPO) runs the four-GEMM path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err
from test_objective import _inputs, _unfused

import jaxrl_kernels as jk
from jaxrl_kernels import contract, rl
from jaxrl_kernels.gemm import matmul2d
from jaxrl_kernels.linear_logp import BackwardConfig
from jaxrl_kernels.linear_logp.reference import linear_logp_reference

THREE = BackwardConfig(passes=3)


def _loss(d, impl, *, config, use_bias=True, temperature=1.0, layout="hv", **kw):
  def f(hidden, weight, bias):
    return rl.linear_policy_loss(hidden, weight, d["targets"], old_logp=d["old"],
                                 advantages=d["adv"], mask=d["mask"],
                                 bias=bias if use_bias else None, temperature=temperature,
                                 weight_layout=layout, implementation=impl, config=config,
                                 **kw)
  return f


def _run(f, d, weight=None):
  g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
  return g(d["hidden"], d["weight"] if weight is None else weight, d["bias"])


CASES = [  # implementation, dtype, bias, temperature, layout, objective kwargs
    ("cpu", "float32", True, 0.7, "hv", dict(beta=0.05, entropy_coef=0.01, dual_clip=3.0)),
    ("cpu", "bfloat16", False, 1.0, "vh", dict(beta=0.04, kl_kind="k2", token_level=False)),
    ("cpu", "float32", False, 1.3, "vh", dict(clip_high=0.28, denominator=7.0)),
    ("interpret", "float32", True, 0.7, "hv", dict(beta=0.05, kl_kind="k1",
                                                   entropy_coef=0.01)),
    pytest.param("interpret", "bfloat16", True, 1.0, "vh", dict(entropy_coef=0.02),
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("impl,dtype,use_bias,temperature,layout,kw", CASES)
def test_three_gemm_keeps_the_heads_bits_and_the_four_gemm_gradients(impl, dtype, use_bias,
                                                                     temperature, layout,
                                                                     kw):
  d = _inputs(dtype)
  kw = dict(kw, ref_logp=d["ref"]) if "beta" in kw else dict(kw)
  w = d["weight"] if layout == "hv" else d["weight"].T
  common = dict(use_bias=use_bias, temperature=temperature, layout=layout, **kw)
  (loss3, m3), g3 = _run(_loss(d, impl, config=THREE, **common), d, w)
  (loss4, m4), g4 = _run(_loss(d, impl, config=None, **common), d, w)
  assert_bitwise_equal(m3["logp"], m4["logp"], "logp, three vs four GEMMs")
  assert_bitwise_equal(m3["entropy"], m4["entropy"], "entropy, three vs four GEMMs")
  lp, ent = jk.linear_logp(d["hidden"], w, d["targets"], mask=d["mask"],
                           bias=d["bias"] if use_bias else None, temperature=temperature,
                           weight_layout=layout, return_entropy=True, implementation=impl)
  assert_bitwise_equal(m3["logp"], lp, "logp vs linear_logp")
  assert_bitwise_equal(m3["entropy"], jnp.where(d["mask"], ent, 0.0), "entropy vs linear_logp")
  assert np.isfinite(float(loss3))
  assert abs(float(loss3) - float(loss4)) <= 1e-6 * max(1.0, abs(float(loss4)))
  for name in m4:
    np.testing.assert_allclose(np.asarray(m3[name]), np.asarray(m4[name]), rtol=1e-6,
                               atol=1e-7, err_msg=name)
  grad_tol = 1e-6 if dtype == "float32" else 8e-3  # a 16-bit dz and dW round differently
  for name, a, b in zip(("dhidden", "dweight", "dbias"), g3, g4):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert rel_err(a, np.asarray(b, np.float64)) <= grad_tol, name
  assert float(jnp.max(jnp.abs(g3[0].astype(jnp.float32)))) > 0
  # Masked rows are inert: NaN there changes no bit of the loss or of dH.
  poisoned = jnp.where(d["mask"][..., None], d["hidden"], jnp.nan)
  (loss_p, _), g_p = _run(_loss(d, impl, config=THREE, **common), dict(d, hidden=poisoned), w)
  assert_bitwise_equal(loss_p, loss3, "loss with NaN in masked rows")
  assert_bitwise_equal(g_p[0], g3[0], "dH with NaN in masked rows")


def test_three_gemm_meets_the_float64_truth():
  d = _inputs("float32", seed=1)
  kw = dict(ref_logp=d["ref"], beta=0.05, entropy_coef=0.01)
  (loss, m), (dh, dw, db) = _run(_loss(d, "cpu", config=THREE, temperature=0.7, **kw), d)
  ref = linear_logp_reference(d["hidden"], d["weight"], d["targets"], bias=d["bias"],
                              temperature=0.7, mask=d["mask"])
  lp64, ent64 = (jnp.asarray(ref[k], jnp.float32) for k in ("logp", "entropy"))
  g_logp, g_ent = jax.grad(lambda lp, en: rl.policy_loss(lp, d["old"], d["adv"], entropy=en,
                                                         mask=d["mask"], **kw)[0],
                           argnums=(0, 1))(lp64, ent64)
  loss64 = rl.policy_loss(lp64, d["old"], d["adv"], entropy=ent64, mask=d["mask"], **kw)[0]
  ref = linear_logp_reference(d["hidden"], d["weight"], d["targets"], bias=d["bias"],
                              temperature=0.7, mask=d["mask"], g_logp=g_logp, g_ent=g_ent)
  assert abs(float(loss) - float(loss64)) <= 1e-5 * max(1.0, abs(float(loss64)))
  for got, key in ((dh, "dh"), (dw, "dw"), (db, "db")):
    assert rel_err(got, ref[key]) <= TOL["float32"][1], key
  # The unfused composition: the same loss to float rounding.
  loss_u, _ = jax.jit(_unfused(d, "cpu", use_bias=True, temperature=0.7, **kw))(
      d["hidden"], d["weight"], d["bias"])
  assert abs(float(loss) - float(loss_u)) <= 1e-6 * max(1.0, abs(float(loss_u)))


def test_dh_rows_invariant_to_batch_padding_and_chunk_and_dw_to_the_chunk():
  n_tok = 300  # two dW blocks of 256 rows, the second partly padding
  d = _inputs("float32", seed=2, b=1, t=n_tok)
  adv = jnp.linspace(-1.0, 1.0, n_tok, dtype=jnp.float32)[None]  # per token

  def grads(n, chunk=None, pad=0):
    cfg = BackwardConfig(passes=3, token_chunk=chunk)
    sl = slice(0, n)
    mask = jnp.pad(d["mask"][:, sl], ((0, 0), (0, pad)))
    hidden = jnp.pad(d["hidden"][:, sl], ((0, 0), (0, pad), (0, 0)), constant_values=3.0)

    def f(hidden, weight):
      pad2 = ((0, 0), (0, pad))
      return rl.linear_policy_loss(
          hidden, weight, jnp.pad(d["targets"][:, sl], pad2),
          old_logp=jnp.pad(d["old"][:, sl], pad2), advantages=jnp.pad(adv[:, sl], pad2),
          mask=mask, denominator=64.0, entropy_coef=0.01, temperature=0.7,
          implementation="cpu", config=cfg)[0]
    return jax.jit(jax.grad(f, argnums=(0, 1)))(hidden, d["weight"])

  dh, dw = grads(n_tok)
  for chunk in (512, 768):
    dh_c, dw_c = grads(n_tok, chunk)
    assert_bitwise_equal(dh_c, dh, f"dH rows at token chunk {chunk}")
    assert_bitwise_equal(dw_c, dw, f"dW at token chunk {chunk}")
  for n in (1, 37):
    assert_bitwise_equal(grads(n)[0], dh[:, :n], f"dH rows at {n} tokens")
  dh_p, dw_p = grads(n_tok, pad=40)  # 40 masked rows appended
  assert_bitwise_equal(dh_p[:, :n_tok], dh, "dH rows with padding")
  assert_bitwise_equal(dw_p, dw, "dW with masked padding rows")
  for _ in range(2):
    assert_bitwise_equal(grads(n_tok)[1], dw, "dW run to run")


def test_dw_block_order_is_visible_in_the_bits():
  """Control: the same token products summed in 512-token groups (the order a dW accumulated
  per 512-token chunk would take) give other bits than the contract's 256-token blocks."""
  b = contract.OBJECTIVE_DW_TOKEN_BLOCK
  rng = np.random.default_rng(0)
  scale = 2.0 ** rng.integers(-10, 11, (2 * b, 1))
  x = jnp.asarray(rng.standard_normal((2 * b, 32)) * scale, jnp.float32)
  dz = jnp.asarray(rng.standard_normal((2 * b, 96)), jnp.float32)

  def mm(a, c):
    return matmul2d(a, c, lhs_transposed=True, rhs_transposed=False, out_dtype=jnp.float32,
                    implementation="cpu")

  blocks = (jnp.zeros((32, 96)) + mm(x[:b], dz[:b])) + mm(x[b:], dz[b:])
  grouped = jnp.zeros((32, 96)) + mm(x, dz)
  assert not np.array_equal(bits(blocks), bits(grouped))


def test_gspo_runs_the_four_gemm_path_and_bad_configs_are_named():
  d = _inputs("float32", seed=3)
  kw = dict(objective="gspo", segment_ids=jnp.broadcast_to(jnp.arange(3)[:, None], (3, 11)),
            entropy_coef=0.01)
  (l3, _), g3 = _run(_loss(d, "cpu", config=THREE, **kw), d)
  (l4, _), g4 = _run(_loss(d, "cpu", config=None, **kw), d)
  assert_bitwise_equal(l3, l4, "GSPO loss")
  for a, b in zip(g3, g4):
    assert_bitwise_equal(a, b, "GSPO gradients")
  with pytest.raises(ValueError, match="token_chunk must be a multiple"):
    BackwardConfig(passes=3, token_chunk=100)
  with pytest.raises(ValueError, match="passes must be one of"):
    BackwardConfig(passes=2)
