"""Expert parallelism: the MoE layer under ``shard_map`` with experts split over a mesh axis
(EP = 1, 2, 4, 8 on the CPU host mesh; EP = 2 on two GPUs) gives every token's output and
input gradient bitwise as one device does, and the expert weights' gradients bitwise too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_kernels._compat import shard_map
from jaxrl_kernels.moe import moe_mlp

H, E, FFN, K, T = 64, 8, 32, 2, 48


def _inputs(dtype):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((T, H)) * 2.0 ** rng.integers(-6, 7, (T, 1)), dtype)
  router = jnp.asarray(rng.standard_normal((H, E)) * 0.3, dtype)
  gate_up = jnp.asarray(rng.standard_normal((E, H, 2 * FFN)) * 0.1, dtype)
  down = jnp.asarray(rng.standard_normal((E, FFN, H)) * 0.1, dtype)
  g = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  return x, router, gate_up, down, g


def _loss(fn, g):
  return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * g)


def _run(ep, impl, dtype):
  x, router, gate_up, down, g = _inputs(dtype)
  if ep is None:
    def f(x, r, gu, d):
      return moe_mlp(x, r, gu, d, k=K, normalize=True, implementation=impl).y
  else:
    mesh = Mesh(np.array(jax.devices()[:ep]), ("expert",))

    def body(x, r, gu, d):
      return moe_mlp(x, r, gu, d, k=K, normalize=True, implementation=impl,
                     expert_axis="expert").y
    f = shard_map(body, mesh=mesh, in_specs=(P("expert"), P(), P("expert"), P("expert")),
                  out_specs=P("expert"), check_vma=False)
  y = jax.jit(f)(x, router, gate_up, down)
  grads = jax.jit(jax.grad(_loss(f, g), argnums=(0, 2, 3)))(x, router, gate_up, down)
  return y, grads


@pytest.mark.parametrize("ep", [
    pytest.param(n, marks=pytest.mark.skipif(len(jax.devices()) < n,
                                             reason=f"needs {n} devices (CPU: 8 host devices)"))
    for n in (1, 2, 4, 8)])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_expert_parallel_equals_one_device_bitwise(ep, dtype):
  impl = "cpu" if jax.default_backend() == "cpu" else "triton"
  y0, (dx0, dgu0, dd0) = _run(None, impl, dtype)
  y, (dx, dgu, dd) = _run(ep, impl, dtype)
  assert_bitwise_equal(y, y0, f"EP={ep} output")
  assert_bitwise_equal(dx, dx0, f"EP={ep} dx")
  assert_bitwise_equal(dgu, dgu0, f"EP={ep} d gate_up")
  assert_bitwise_equal(dd, dd0, f"EP={ep} d down")


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (CPU: 8 host devices)")
def test_expert_axis_must_split_the_experts_evenly():
  x, router, gate_up, down, _ = _inputs("float32")
  mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  f = shard_map(lambda x, r, gu, d: moe_mlp(x, r, gu, d, k=K, normalize=True,
                                            expert_axis="expert").y,
                mesh=mesh, in_specs=(P("expert"), P(), P(), P()), out_specs=P("expert"),
                check_vma=False)
  with pytest.raises(ValueError, match="ep=2"):
    f(x, router, gate_up, down)
