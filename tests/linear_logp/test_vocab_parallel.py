"""Vocab-parallel linear_logp on the 8-device CPU mesh: bitwise TP invariance, gradients, errors."""

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, assert_bitwise_equal, bits, rel_err
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_kernels._compat import shard_map
from jaxrl_kernels.linear_logp import VOCAB_TILE, BackwardConfig, api, linear_logp
from jaxrl_kernels.linear_logp.vocab_parallel import (
  pad_vocab,
  padded_vocab_size,
  vocab_parallel_linear_logp,
  vocab_parallel_logp,
)

IMPL = "interpret"
T, H, V = 20, 32, 1000  # V is not a tile multiple: the last global tile is partial


def _mesh(*shape, names=("tp",)):
  n = int(np.prod(shape))
  return Mesh(np.asarray(jax.devices()[:n]).reshape(shape), names)


def _case(dtype=jnp.float32, t=T, h=H, v=V, seed=0, spread=20):
  """Rows scaled by 2**[-spread, spread]: a re-associated merge rounds differently."""
  k = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(k[0], (t, h), jnp.float32) * 0.5
  x = x * 2.0 ** (jnp.linspace(-spread, spread, t) / 4).round()[:, None]
  w = jax.random.normal(k[1], (h, v), jnp.float32) / np.sqrt(h) * 4
  tg = jax.random.randint(k[2], (t,), 0, v)
  bias = jax.random.normal(k[3], (v,), jnp.float32)
  mask = jax.random.bernoulli(k[4], 0.8, (t,))
  return x.astype(dtype), w.astype(dtype), tg, bias, mask


def _unsharded(x, w, tg, **kw):
  return linear_logp(x, w, tg, return_entropy=True, implementation=IMPL, **kw)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_degree_bitwise_equal_to_unsharded(tp):
  x, w, tg, _, _ = _case()
  ref_lp, ref_ent = _unsharded(x, w, tg)
  wp = pad_vocab(w, tp)
  lp, ent = jax.jit(functools.partial(
      vocab_parallel_logp, mesh=_mesh(tp), weight_spec=P(None, "tp"), vocab_size=V,
      return_entropy=True, implementation=IMPL))(x, wp, tg)
  assert_bitwise_equal(lp, ref_lp, f"logp TP={tp}")
  assert_bitwise_equal(ent, ref_ent, f"entropy TP={tp}")


def test_tp3_padding_vh_layout_bias_temperature_mask():
  x, w, tg, bias, mask = _case(seed=1)
  tg = jnp.where(mask, tg, -100)  # masked ids may be anything
  kw = dict(temperature=0.7, mask=mask)
  ref_lp, ref_ent = _unsharded(x, w.T, tg, bias=bias, weight_layout="vh", **kw)
  assert padded_vocab_size(V, 3) == 3 * 384
  wp, bp = pad_vocab(w.T, 3, weight_layout="vh", bias=bias)
  lp, ent = vocab_parallel_logp(x, wp, tg, mesh=_mesh(3), weight_spec=P("tp", None),
                                vocab_size=V, bias=bp, weight_layout="vh", return_entropy=True,
                                implementation=IMPL, **kw)
  assert_bitwise_equal(lp, ref_lp, "logp TP=3")
  assert_bitwise_equal(ent, ref_ent, "entropy TP=3")
  assert np.all(np.asarray(lp)[~np.asarray(mask)] == 0)


def test_bf16_and_fp32_head_bitwise():
  x, w, tg, _, _ = _case(jnp.bfloat16, seed=2)
  for fp32_head in (False, True):
    ref_lp, ref_ent = _unsharded(x, w, tg, fp32_head=fp32_head)
    lp, ent = jax.jit(functools.partial(
        vocab_parallel_logp, mesh=_mesh(4), weight_spec=P(None, "tp"), vocab_size=V,
        return_entropy=True, fp32_head=fp32_head, implementation=IMPL))(x, pad_vocab(w, 4), tg)
    assert_bitwise_equal(lp, ref_lp, f"bf16 logp fp32_head={fp32_head}")
    assert_bitwise_equal(ent, ref_ent, f"bf16 entropy fp32_head={fp32_head}")


def test_two_dim_mesh_data_by_tp():
  x, w, tg, _, mask = _case(t=24, seed=3)
  ref_lp, ref_ent = _unsharded(x, w, tg, mask=mask)
  sharded = functools.partial(
      vocab_parallel_logp, mesh=_mesh(2, 4, names=("data", "tp")), weight_spec=P(None, "tp"),
      token_spec=P("data"), vocab_size=V, mask=mask, return_entropy=True, implementation=IMPL)
  lp, ent = jax.jit(sharded)(x, pad_vocab(w, 4), tg)
  assert_bitwise_equal(lp, ref_lp, "logp data x TP")
  assert_bitwise_equal(ent, ref_ent, "entropy data x TP")

  # Gradients through the 2-D shard_map (taken outside it).
  def ref_loss(h, ww):
    lp, ent = _unsharded(h, ww, tg, mask=mask)
    return jnp.sum(ent * 0.5 + lp)

  ref_g = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(x, w)

  def loss(h, ww):
    lp, ent = sharded(h, ww, tg)
    return jnp.sum(ent * 0.5 + lp)

  dh, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, pad_vocab(w, 4))
  assert rel_err(dh, ref_g[0]) < TOL["float32"][1]
  assert rel_err(dw[:, :V], ref_g[1]) < TOL["float32"][1]


def test_direct_call_inside_users_shard_map():
  x, w, tg, _, _ = _case(seed=4)
  ref_lp = _unsharded(x, w, tg)[0]
  mesh = _mesh(8)

  def body(h, ws, t):
    return vocab_parallel_linear_logp(h, ws, t, axis_name="tp", vocab_size=V, implementation=IMPL)

  lp = shard_map(body, mesh=mesh, in_specs=(P(), P(None, "tp"), P()), out_specs=P(),
                 check_vma=False)(x, pad_vocab(w, 8), tg)
  assert_bitwise_equal(lp, ref_lp, "direct shard_map")


@pytest.mark.parametrize("tp, v", [pytest.param(2, 100, marks=pytest.mark.slow),
                                   pytest.param(4, 300, marks=pytest.mark.slow), (8, 200)])
def test_shards_of_padding_only(tp, v):
  """A vocabulary smaller than (tp - 1) tiles: the last shards hold padding only (what
  pad_vocab gives). Logp and entropy bitwise the unsharded op's, gradients to tolerance,
  the psum merge finite and to tolerance."""
  # One tile per shard: the shards past ceil(v / 128) hold padding only.
  x, w, tg, _, mask = _case(v=v, seed=11, spread=4)
  ref_lp, ref_ent = _unsharded(x, w, tg, mask=mask)
  wp = pad_vocab(w, tp)
  assert wp.shape[1] == tp * VOCAB_TILE
  kw = dict(mesh=_mesh(tp), weight_spec=P(None, "tp"), vocab_size=v, mask=mask,
            return_entropy=True, implementation=IMPL)
  lp, ent = jax.jit(functools.partial(vocab_parallel_logp, **kw))(x, wp, tg)
  assert_bitwise_equal(lp, ref_lp, f"logp TP={tp}")
  assert_bitwise_equal(ent, ref_ent, f"entropy TP={tp}")
  lp2, ent2 = jax.jit(functools.partial(vocab_parallel_logp, merge="psum", **kw))(x, wp, tg)
  assert np.all(np.isfinite(np.asarray(lp2))) and np.all(np.isfinite(np.asarray(ent2)))
  assert rel_err(lp2, ref_lp) < TOL["float32"][0]
  assert rel_err(ent2, ref_ent) < 1e-4

  def loss(f, h, ww):
    lp, ent = f(h, ww)
    return jnp.sum(lp + 0.5 * ent)

  ref_g = jax.grad(functools.partial(loss, lambda h, ww: _unsharded(h, ww, tg, mask=mask)),
                   argnums=(0, 1))(x, w)
  dh, dw = jax.jit(jax.grad(functools.partial(
      loss, lambda h, ww: vocab_parallel_logp(h, ww, tg, **kw)), argnums=(0, 1)))(x, wp)
  assert rel_err(dh, ref_g[0]) < TOL["float32"][1]
  assert rel_err(dw[:, :v], ref_g[1]) < TOL["float32"][1]
  assert np.all(np.asarray(dw[:, v:]) == 0), "padding columns get no gradient"


def test_psum_merge_control_changes_bits():
  """The per-shard merge re-associates the fold: right to tolerance, wrong in the bits."""
  x, w, tg, _, _ = _case(t=32, seed=5, spread=40)
  ref_lp, ref_ent = _unsharded(x, w, tg)
  changed = 0
  for tp in (2, 4, 8):
    lp, ent = jax.jit(functools.partial(
        vocab_parallel_logp, mesh=_mesh(tp), weight_spec=P(None, "tp"), vocab_size=V,
        return_entropy=True, merge="psum", implementation=IMPL))(x, pad_vocab(w, tp), tg)
    assert rel_err(lp, ref_lp) < TOL["float32"][0]
    assert rel_err(ent, ref_ent) < 1e-4
    changed += int(np.sum(bits(lp) != bits(ref_lp)) + np.sum(bits(ent) != bits(ref_ent)))
  assert changed > 0, "the psum merge was expected to change some bits"


def _grad_case():
  x, w, tg, bias, mask = _case(t=16, seed=6, spread=4)
  gl = jax.random.normal(jax.random.key(7), (16,))
  ge = jax.random.normal(jax.random.key(8), (16,))

  def loss(fn, h, ww, b):
    lp, ent = fn(h, ww, b)
    return jnp.sum(gl * lp + ge * ent)

  return x, w, tg, bias, mask, loss


@functools.cache
def _unsharded_grads():
  """The unsharded gradients of :func:`_grad_case`'s loss, computed once for every TP degree."""
  x, w, tg, bias, mask, loss = _grad_case()
  return jax.jit(jax.grad(functools.partial(loss, lambda h, ww, b: _unsharded(
      h, ww, tg, bias=b, mask=mask, temperature=1.3)), argnums=(0, 1, 2)))(x, w, bias)


@pytest.mark.parametrize("tp", [2, 4])
def test_gradients_match_unsharded(tp):
  x, w, tg, bias, mask, loss = _grad_case()
  ref = _unsharded_grads()
  wp, bp = pad_vocab(w, tp, bias=bias)
  fn = lambda h, ww, b: vocab_parallel_logp(
      h, ww, tg, mesh=_mesh(tp), weight_spec=P(None, "tp"), vocab_size=V, bias=b, mask=mask,
      temperature=1.3, return_entropy=True, implementation=IMPL)
  dh, dw, db = jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2)))(x, wp, bp)
  tol = TOL["float32"][1]
  assert rel_err(dh, ref[0]) < tol
  assert rel_err(dw[:, :V], ref[1]) < tol
  assert rel_err(db[:V], ref[2]) < tol
  assert np.all(np.asarray(dw[:, V:]) == 0) and np.all(np.asarray(db[V:]) == 0)
  masked_rows = ~np.asarray(mask)
  assert np.all(np.asarray(dh)[masked_rows] == 0)


def test_out_of_range_active_target_is_nan_under_jit():
  x, w, tg, _, _ = _case(seed=9)
  tg = tg.at[3].set(V + 5)  # in the padding columns of the last shard
  fn = jax.jit(lambda t: vocab_parallel_logp(x, pad_vocab(w, 4), t, mesh=_mesh(4),
                                             weight_spec=P(None, "tp"), vocab_size=V,
                                             implementation=IMPL))
  lp = np.asarray(fn(tg))
  assert np.isnan(lp[3]) and np.all(np.isfinite(np.delete(lp, 3)))
  with pytest.raises(ValueError, match=r"targets must lie in \[0, 1000\)"):
    vocab_parallel_logp(x, pad_vocab(w, 4), tg, mesh=_mesh(4), weight_spec=P(None, "tp"),
                        vocab_size=V, implementation=IMPL)


def test_bad_layouts_raise():
  x, w, tg, _, _ = _case()
  kw = dict(vocab_size=V, implementation=IMPL)
  assert (V // 2) % VOCAB_TILE  # 2 x 500 columns: off the tile grid
  with pytest.raises(ValueError, match="tile grid.*pad the vocabulary to 1024"):
    vocab_parallel_logp(x, w, tg, mesh=_mesh(2), weight_spec=P(None, "tp"), **kw)
  with pytest.raises(ValueError, match="split the vocab dimension"):
    vocab_parallel_logp(x, pad_vocab(w, 2), tg, mesh=_mesh(2), weight_spec=P("tp", None), **kw)
  with pytest.raises(ValueError, match="not in the mesh axes"):
    vocab_parallel_logp(x, pad_vocab(w, 2), tg, mesh=_mesh(2), weight_spec=P(None, "x"), **kw)
  with pytest.raises(ValueError, match="do not split evenly"):
    vocab_parallel_logp(x, w, tg, mesh=_mesh(3), weight_spec=P(None, "tp"), **kw)
  # More padding than pad_vocab gives (shards 4..7 all padding) is wasteful, not wrong.
  assert_bitwise_equal(
      vocab_parallel_logp(x, jnp.pad(w, ((0, 0), (0, 2048 - V))), tg, mesh=_mesh(8),
                          weight_spec=P(None, "tp"), vocab_size=V, implementation=IMPL),
      _unsharded(x, w, tg)[0], "over-padded vocabulary")
  with pytest.raises(ValueError, match="cover"):
    vocab_parallel_logp(x, pad_vocab(w, 2)[:, :512], tg, mesh=_mesh(2),
                        weight_spec=P(None, "tp"), **kw)
  with pytest.raises(ValueError, match="TP axis"):
    vocab_parallel_logp(x, pad_vocab(w, 2), tg, mesh=_mesh(2), weight_spec=P(None, "tp"),
                        token_spec=P("tp"), **kw)
  with pytest.raises(ValueError, match="merge must be"):
    vocab_parallel_logp(x, pad_vocab(w, 2), tg, mesh=_mesh(2), weight_spec=P(None, "tp"),
                        merge="mean", **kw)


@pytest.mark.parametrize("check_vma,impl", [(True, "cpu"), (False, "cpu"), (False, IMPL)])
def test_gradients_inside_users_shard_map(check_vma, impl):
  """Forward bits and gradients (dH summed over the shards, dW per shard) of a direct call in
  a user's shard_map: typed (check_vma=True, JAX's default) with the CPU default, untyped
  with it and with the interpreted kernels."""
  x, w, tg, _, mask = _case(seed=6)
  ref_lp, ref_ent = linear_logp(x, w, tg, mask=mask, return_entropy=True, implementation=impl)
  wp = pad_vocab(w, 2)

  def body(h, ws, t, m):
    return vocab_parallel_linear_logp(h, ws, t, axis_name="tp", vocab_size=V, mask=m,
                                      return_entropy=True, implementation=impl)

  f = shard_map(body, mesh=_mesh(2), in_specs=(P(), P(None, "tp"), P(), P()),
                out_specs=(P(), P()), check_vma=check_vma)
  lp, ent = jax.jit(f)(x, wp, tg, mask)
  assert_bitwise_equal(lp, ref_lp, f"logp {impl}")
  assert_bitwise_equal(ent, ref_ent, f"entropy {impl}")

  def loss(h, ws):
    lp, ent = f(h, ws, tg, mask)
    return jnp.sum(lp) + 0.5 * jnp.sum(ent)

  def ref_loss(h, w_):
    lp, ent = linear_logp(h, w_, tg, mask=mask, return_entropy=True, implementation=impl)
    return jnp.sum(lp) + 0.5 * jnp.sum(ent)

  dh, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, wp)
  rh, rw = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(x, w)
  assert rel_err(dh, rh) < TOL["float32"][1]
  assert rel_err(dw[:, :V], rw) < TOL["float32"][1]


def test_check_vma_shard_map_gets_a_clear_error():
  x, w, tg, _, _ = _case()
  body = lambda h, ws, t: vocab_parallel_linear_logp(h, ws, t, axis_name="tp", vocab_size=V,  # noqa: E731
                                                     implementation=IMPL)
  f = shard_map(body, mesh=_mesh(2), in_specs=(P(), P(None, "tp"), P()), out_specs=P(),
                check_vma=True)
  with pytest.raises(ValueError, match="check_vma=False\\) only.*implementation='cpu' runs"):
    f(x, pad_vocab(w, 2), tg)


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_global_arrays_on_meshes_from_make_mesh(axis_type):
  """jax.make_mesh meshes (Explicit axes by default, or Auto), unsharded global arrays, eager
  and under jit: resharded as needed, the unsharded op's bits."""
  x, w, tg, _, _ = _case(seed=7)
  ref_lp = _unsharded(x, w, tg)[0]
  kind = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
  mesh = jax.make_mesh((4,), ("tp",), axis_types=(kind[axis_type],),
                       devices=jax.devices()[:4])
  fn = functools.partial(vocab_parallel_logp, mesh=mesh, weight_spec=P(None, "tp"),
                         vocab_size=V, implementation=IMPL)
  assert_bitwise_equal(fn(x, pad_vocab(w, 4), tg), ref_lp, f"eager, {axis_type} mesh")
  assert_bitwise_equal(jax.jit(fn)(x, pad_vocab(w, 4), tg), ref_lp, f"jit, {axis_type} mesh")


def test_validate_catches_rows_that_differ_across_the_tp_axis():
  """Without validate, rows that differ per device give finite wrong values; validate=True
  turns that into a checkify error, and passes when the rows agree."""
  from jax.experimental import checkify

  x, w, tg, _, _ = _case(seed=8)
  wp = pad_vocab(w, 2)

  def run(h_spec, validate):
    body = lambda h, ws, t: vocab_parallel_linear_logp(  # noqa: E731
        h, ws, t, axis_name="tp", vocab_size=V, implementation=IMPL, validate=validate)
    f = shard_map(body, mesh=_mesh(2), in_specs=(h_spec, P(None, "tp"), P()),
                  out_specs=P(), check_vma=False)
    return checkify.checkify(jax.jit(f))

  # P("tp") on the rows of a [2T, H] array: each device sees different hidden rows.
  x2 = jnp.concatenate([x, x[::-1]])
  err, lp = run(P("tp"), False)(x2, wp, tg)
  err.throw()  # nothing checked: a finite wrong answer
  assert np.all(np.isfinite(np.asarray(lp)))
  err, _ = run(P("tp"), True)(x2, wp, tg)
  with pytest.raises(checkify.JaxRuntimeError, match="hidden differs across the devices"):
    err.throw()
  err, lp = run(P(), True)(x, wp, tg)
  err.throw()
  assert_bitwise_equal(lp, _unsharded(x, w, tg)[0], "validated")


def test_misleading_names_fixed():
  x, w, tg, _, _ = _case()
  with pytest.raises(ValueError, match="weight_layout must be one of"):
    vocab_parallel_logp(x, pad_vocab(w, 2), tg, mesh=_mesh(2), weight_spec=P(None, "tp"),
                        weight_layout="bad", implementation=IMPL)
  with pytest.raises(ValueError, match="pad_vocab: weight_layout must be one of"):
    pad_vocab(w, 8, weight_layout="HV")


def test_no_entropy_reaches_the_kernels_as_a_hint():
  """``return_entropy=False`` reaches the backend's forward and backward as ``entropy=False``
  (a kernel may then leave the entropy's terms out; the Mosaic ones do), in the unsharded
  and the vocab-parallel op alike, and ``True`` otherwise. logp keeps its bits; with the
  GEMM backward (which leaves the entropy term out) the TP = 4 gradients equal, as values,
  those of the entropy-returning call whose entropy the loss leaves unused."""
  x, w, tg, _, _ = _case(seed=6)
  seen = []

  def record(f, what):
    def call(*args, **kw):
      seen.append((what, kw.get("entropy", True)))
      return f(*args, **kw)
    return call

  be = api.backend(IMPL)
  spy = dataclasses.replace(be, tile_partials=record(be.tile_partials, "forward"),
                            backward=record(be.backward, "backward"))
  cfg = BackwardConfig(kernel="gemm")
  wp = pad_vocab(w, 4)
  gl = jax.random.normal(jax.random.key(7), (T,))

  def run(entropy, sharded):
    def loss(h, ww):
      if sharded:
        out = vocab_parallel_logp(h, ww, tg, mesh=_mesh(4), weight_spec=P(None, "tp"),
                                  vocab_size=V, return_entropy=entropy, config=cfg,
                                  implementation=IMPL)
      else:
        out = linear_logp(h, ww, tg, return_entropy=entropy, config=cfg, implementation=IMPL)
      lp = out[0] if entropy else out
      return jnp.sum(lp * gl), lp
    seen.clear()
    with mock.patch.dict(api.BACKENDS, {IMPL: spy}):
      (_, lp), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
          x, wp if sharded else w)
    assert {e for _, e in seen} == {entropy} and {k for k, _ in seen} == {"forward", "backward"}
    return lp, grads

  for sharded in (False, True):
    lp, grads = run(False, sharded)
    lp_e, grads_e = run(True, sharded)
    assert_bitwise_equal(lp, lp_e, f"logp without vs with the entropy, sharded={sharded}")
    for name, a, b in zip(("dh", "dw"), grads, grads_e, strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} {sharded}")
