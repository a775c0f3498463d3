"""The op's structure holds what the contract needs: one dispatch table, contract constants
from contract.py only (never a tuning knob), no environment switches, a module that holds
parameters only."""

import dataclasses
import inspect
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_bitwise_equal

import jaxrl_kernels
from jaxrl_kernels import contract
from jaxrl_kernels.linear_logp import BACKENDS, api, head_logits, linear_logp, tile_partials
from jaxrl_kernels.nn import lm_head
from jaxrl_kernels.pallas import linear_logp_bwd, linear_logp_fwd, linear_logp_mosaic

PKG = pathlib.Path(jaxrl_kernels.__file__).parent
OP_FILES = sorted((PKG / "linear_logp").glob("*.py")) + sorted(
    (PKG / "pallas").glob("linear_logp*.py")) + [PKG / "pallas" / "lm_head_logits.py",
                                                 PKG / "pallas" / "softmax_partials.py",
                                                 PKG / "nn" / "lm_head.py"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("interpret", [True, False])
def test_logits_h_step_is_the_contract_and_no_config_can_change_it(dtype, interpret):
  want = (contract.LOGITS_BLOCK_H_INTERPRET if interpret
          else contract.LOGITS_BLOCK_H_TRITON[dtype])
  assert linear_logp_fwd.block_h(dtype, interpret) == want
  for cfg in (linear_logp_fwd.default_config(dtype, interpret),
              linear_logp_bwd.default_config(dtype, interpret).logits):
    assert "block_h" not in {f.name for f in dataclasses.fields(cfg)}
  assert linear_logp_fwd.VOCAB_TILE == contract.VOCAB_TILE
  assert linear_logp_mosaic.EPI_ROWS == contract.EPI_ROWS
  assert linear_logp_mosaic.TILE_K == contract.GEMM_TILE_K


def test_one_dispatch_table_with_every_kernel_per_implementation():
  assert tuple(BACKENDS) == api.IMPLEMENTATIONS == ("mosaic", "triton", "interpret", "cpu",
                                                     "xla")
  for name in api.PARTIAL_IMPLEMENTATIONS:
    be = api.backend(name)
    assert be.name == name
    for fn in (be.tile_partials, be.merge_partials, be.backward, be.logits):
      assert callable(fn)


def test_no_environment_switch_and_no_private_cross_module_import():
  for path in OP_FILES:
    src = path.read_text()
    assert "os.environ" not in src and "getenv" not in src, path.name
    for line in src.splitlines():
      if line.startswith("from jaxrl_kernels") and " import _" in line:
        names = line.split(" import ")[1]
        assert names.startswith(("_validation", "_common", "_backend", "_compat")), line


def test_lm_head_module_holds_parameters_only():
  src = inspect.getsource(lm_head)
  assert "pallas" not in src and "custom_vjp" not in src
  emb = nnx.Param(jnp.ones((50, 16)))
  head = lm_head.LMHead(16, 50, tied_embedding=emb, rngs=nnx.Rngs(0))
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    w = head.weight()
    h = head.hidden(jnp.ones((3, 16), jnp.float32))
  assert w.shape == (50, 16) and head.weight_layout == "vh" and h.dtype == w.dtype


def test_head_logits_are_the_logits_the_fused_op_reduces():
  """The logits path is linear_logp with a store epilogue: each logit is the target logit
  tile_partials reduces (bitwise), for every CPU implementation with partials."""
  k = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(k[0], (3, 40), jnp.float32)
  w = jax.random.normal(k[1], (40, 150), jnp.float32) * 0.2
  rows = jnp.repeat(x, 150, axis=0)
  cols = jnp.tile(jnp.arange(150), 3)
  for impl in ("interpret", "cpu"):
    z = head_logits(rows, w, temperature=0.7, implementation=impl)
    z = z[jnp.arange(450), cols]
    tz = tile_partials(rows, w, None, cols, temperature=0.7, implementation=impl)[3]
    assert_bitwise_equal(z, tz, f"{impl}: head_logits vs fused z")
    lp = linear_logp(x, w, jnp.array([0, 7, 149]), temperature=0.7, implementation=impl)
    assert np.all(np.isfinite(np.asarray(lp)))
