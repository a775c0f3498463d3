"""The policy loss fused into a vocab-parallel LM head (``rl.linear_policy_loss(...,
vocab_axis=)``, ``vocab_parallel_linear_objective``) on the 8-device CPU mesh.

Claims: ``logp`` and ``entropy`` are bitwise the unsharded ``linear_logp``'s for TP = 1, 2, 4,
8 (the all-gather merge), and so the loss is the same bits at every TP degree; the gradients
(dH summed over the shards by JAX, dW per shard) equal the unsharded fused loss's to float
rounding, padding columns get none; typed (``check_vma=True``) and untyped ``shard_map``
both work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, rel_err
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_kernels import rl
from jaxrl_kernels._compat import shard_map
from jaxrl_kernels.linear_logp import linear_logp, pad_vocab

B, T, H, V = 2, 8, 32, 1000  # V is not a tile multiple: the last global tile is partial
KW = dict(beta=0.05, entropy_coef=0.01, clip_low=0.2, clip_high=0.28)


def _mesh(tp):
  return Mesh(np.asarray(jax.devices()[:tp]), ("tp",))


@functools.cache
def _case():
  k = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(k[0], (B, T, H), jnp.float32)
  x = x * 2.0 ** jnp.round(jnp.linspace(-4, 4, T))[None, :, None]
  w = jax.random.normal(k[1], (H, V), jnp.float32) / np.sqrt(H) * 4
  tg = jax.random.randint(k[2], (B, T), 0, V)
  mask = jnp.arange(T)[None] < jnp.array([[T], [5]])
  lp = linear_logp(x, w, tg, mask=mask, implementation="cpu")
  old = lp + 0.3 * jax.random.normal(k[3], (B, T))
  ref = lp + 0.3 * jax.random.normal(k[4], (B, T))
  adv = jax.random.normal(k[5], (B,))
  return x, w, tg, mask, old, ref, adv


def _sharded(tp, impl, check_vma):
  x, w, tg, mask, old, ref, adv = _case()

  def body(h, ws, t, m, o, r, a):
    return rl.linear_policy_loss(h, ws, t, old_logp=o, advantages=a, mask=m, ref_logp=r,
                                 vocab_axis="tp", vocab_size=V, implementation=impl, **KW)

  f = shard_map(body, mesh=_mesh(tp), in_specs=(P(), P(None, "tp"), P(), P(), P(), P(), P()),
                out_specs=(P(), P()), check_vma=check_vma)
  return lambda h, ws: f(h, ws, tg, mask, old, ref, adv)


@functools.cache
def _unsharded():
  x, w, tg, mask, old, ref, adv = _case()

  def loss(h, w_):
    return rl.linear_policy_loss(h, w_, tg, old_logp=old, advantages=adv, mask=mask,
                                 ref_logp=ref, implementation="cpu", **KW)

  (value, metrics), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
  return value, metrics, grads


@pytest.mark.parametrize("tp,impl,check_vma", [(1, "cpu", False), (2, "cpu", False),
                                               (4, "cpu", False), (8, "cpu", False),
                                               (2, "cpu", True), (2, "interpret", False)])
def test_logp_and_loss_keep_their_bits_and_gradients_match_the_unsharded_loss(tp, impl,
                                                                            check_vma):
  x, w, *_ = _case()
  value_u, metrics_u, (dh_u, dw_u) = _unsharded()
  wp = pad_vocab(w, tp)
  f = _sharded(tp, impl, check_vma)
  (value, metrics), (dh, dw) = jax.jit(jax.value_and_grad(
      lambda h, ws: f(h, ws), argnums=(0, 1), has_aux=True))(x, wp)
  ref_lp, ref_ent = linear_logp(*_case()[:3], mask=_case()[3], return_entropy=True,
                                implementation=impl)
  assert_bitwise_equal(metrics["logp"], ref_lp, f"logp TP={tp}")
  assert_bitwise_equal(metrics["entropy"], ref_ent, f"entropy TP={tp}")
  if impl == "cpu":
    assert_bitwise_equal(metrics["logp"], metrics_u["logp"], "logp vs the unsharded loss")
    assert_bitwise_equal(value, value_u, f"loss TP={tp} vs unsharded")
  assert sorted(metrics) == sorted(metrics_u)
  tol = TOL["float32"][1]
  assert rel_err(dh, dh_u) < tol
  assert rel_err(dw[:, :V], dw_u) < tol
  assert np.all(np.asarray(dw[:, V:]) == 0), "padding columns got a gradient"
  assert np.all(np.asarray(dh)[~np.asarray(_case()[3])] == 0), "masked rows got a gradient"


def test_arguments_are_checked():
  x, w, tg, mask, old, _, adv = _case()

  def call(**kw):
    body = lambda h, ws: rl.linear_policy_loss(h, ws, tg, old_logp=old, advantages=adv,  # noqa: E731
                                               mask=mask, implementation="cpu", **kw)[0]
    f = shard_map(body, mesh=_mesh(2), in_specs=(P(), P(None, "tp")), out_specs=P(),
                  check_vma=False)
    return f(x, pad_vocab(w, 2))

  with pytest.raises(ValueError, match="needs vocab_size"):
    call(vocab_axis="tp")
  with pytest.raises(ValueError, match="must not name vocab_axis 'tp'"):
    call(vocab_axis="tp", vocab_size=V, axis_names=("tp",))
  with pytest.raises(ValueError, match="tile grid"):
    f = shard_map(lambda h, ws: rl.linear_policy_loss(
        h, ws, tg, old_logp=old, advantages=adv, vocab_axis="tp", vocab_size=V,
        implementation="cpu")[0], mesh=_mesh(2), in_specs=(P(), P(None, "tp")),
        out_specs=P(), check_vma=False)
    f(x, jnp.pad(w, ((0, 0), (0, 1002 - V))))
