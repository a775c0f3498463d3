"""docs_per_step accumulation: accumulated gradient == one-big-batch gradient.

Claim (docs/rl.md): to float32 tolerance (rel 1e-5; the micro-batch sums are
re-associated), not bitwise. The control (each micro-batch normalised by its own
document count) is off by far more.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import rel_err
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_kernels import rl
from jaxrl_kernels._compat import shard_map
from jaxrl_kernels.train import Trainer, TrainState

D, V, T = 8, 11, 6
ACC_TOL = 1e-5


def _params(seed=0, dtype=jnp.float32):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w": (jax.random.normal(k1, (D, V)) * 0.5).astype(dtype),
          "b": (jax.random.normal(k2, (V,)) * 0.1).astype(dtype)}


def _micro_batch(rows, seed, empty_rows=()):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, T + 1, size=rows)
  lengths[list(empty_rows)] = 0  # padding rows: no document
  return {
      "x": rng.normal(size=(rows, T, D)).astype(np.float32),
      "tokens": rng.integers(0, V, size=(rows, T)).astype(np.int32),
      "mask": np.arange(T)[None, :] < lengths[:, None],
      "old_logp": (-np.log(V) + 0.3 * rng.normal(size=(rows, T))).astype(np.float32),
      "adv": rng.normal(size=rows).astype(np.float32),
  }


def count_documents(batch) -> int:
  return int(np.asarray(batch["mask"]).any(-1).sum())


def _logp(params, batch):
  # HIGHEST: true fp32 on GPUs too (never TF32), so the 1e-5 comparisons hold there.
  logits = jnp.einsum("btd,dv->btv", batch["x"], params["w"].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) + params["b"]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, batch["tokens"][..., None], axis=-1)[..., 0]


def loss_fn(params, batch, num_documents):
  """GRPO-style sequence-mean loss, normalised by the step's document count."""
  loss, _ = rl.ppo_clip_loss(_logp(params, batch), batch["old_logp"], batch["adv"],
                             mask=batch["mask"], token_level=False, denominator=num_documents)
  return loss


def _concat(batches):
  return jax.tree.map(lambda *xs: np.concatenate(xs), *batches)


_grad = jax.jit(jax.grad(loss_fn))


def _one_batch_grad(params, batches):
  big = _concat(batches)
  return _grad(params, big, jnp.float32(count_documents(big)))


def _assert_grads_close(got, want, tol=ACC_TOL):
  for k in want:
    assert rel_err(got[k], want[k]) <= tol, k


def test_static_accumulation_uneven_micro_batches():
  params = _params()
  mbs = [_micro_batch(1, 1), _micro_batch(3, 2, empty_rows=(1,)), _micro_batch(2, 3)]
  trainer = Trainer(loss_fn, optax.sgd(0.1), count_documents=count_documents, micro_batches=3)
  pulled, n = trainer.pull(iter(mbs))
  assert len(pulled) == 3 and n == 5  # one padding row has no document
  grads, loss, _ = trainer.gradients(params, pulled, n)
  want = _one_batch_grad(params, mbs)
  _assert_grads_close(grads, want)
  big = _concat(mbs)
  assert rel_err(loss, jax.jit(loss_fn)(params, big, jnp.float32(5))) <= ACC_TOL
  # Control: normalising each micro-batch by its own count gives another gradient.
  wrong = jax.tree.map(lambda *g: sum(g), *[
      _grad(params, mb, jnp.float32(count_documents(mb))) for mb in mbs])
  assert rel_err(wrong["w"], want["w"]) > 1e-2
  # One optimizer update per step, with the accumulated gradient.
  state, metrics = trainer.step(trainer.init(params), iter(mbs))
  assert state.step == 1 and metrics["num_micro_batches"] == 3
  assert metrics["num_documents"] == 5 and metrics["documents_seen"] == 5
  for k in params:
    expect = np.asarray(params[k], np.float64) - 0.1 * np.asarray(want[k], np.float64)
    assert rel_err(state.params[k], expect) <= ACC_TOL


def test_dynamic_docs_per_step_overshoot_and_counters():
  params = _params(1)
  # Documents per micro-batch: 2, 1, 3 | 4 | 1, 0, 2, 2 | 1 (partial last step)
  specs = [(2, ()), (1, ()), (3, ()), (5, (0,)), (1, ()), (1, (0,)), (2, ()), (3, (1,)), (1, ())]
  mbs = [_micro_batch(rows, 10 + i, empty) for i, (rows, empty) in enumerate(specs)]
  assert [count_documents(b) for b in mbs] == [2, 1, 3, 4, 1, 0, 2, 2, 1]
  trainer = Trainer(loss_fn, optax.sgd(0.05), count_documents=count_documents, docs_per_step=4)
  state = trainer.init(params)
  it = iter(mbs)
  expected = [(3, 6, 6), (1, 4, 10), (4, 5, 15), (1, 1, 16)]  # (micro-batches, docs, seen)
  start = 0
  for n_mb, n_docs, seen in expected:
    old_params = state.params
    state, metrics = trainer.step(state, it)
    assert (metrics["num_micro_batches"], metrics["num_documents"],
            metrics["documents_seen"]) == (n_mb, n_docs, seen)
    assert state.documents_seen == seen
    want = _one_batch_grad(old_params, mbs[start:start + n_mb])
    for k in params:
      expect = np.asarray(old_params[k], np.float64) - 0.05 * np.asarray(want[k], np.float64)
      assert rel_err(state.params[k], expect) <= ACC_TOL
    start += n_mb
  assert state.step == 4
  with pytest.raises(StopIteration):
    trainer.step(state, it)


def test_grad_fn_compiled_once_per_shape():
  traces = []

  def counting_loss(params, batch, num_documents):
    traces.append(batch["x"].shape)
    return loss_fn(params, batch, num_documents)

  trainer = Trainer(counting_loss, optax.adam(1e-3), count_documents=count_documents,
                    docs_per_step=3)
  state = trainer.init(_params(2))
  mbs = [_micro_batch(r, 20 + i) for i, r in enumerate([2, 3, 2, 3, 2, 3, 2, 3])]
  for _ in range(3):
    state, metrics = trainer.step(state, iter(mbs[:2]) if _ == 0 else iter(mbs))
  # Two shapes, two traces, whatever the document counts (traced divisor).
  assert sorted(traces) == [(2, T, D), (3, T, D)]


def test_aux_is_summed_and_low_precision_params():
  def aux_loss(params, batch, num_documents):
    loss, m = rl.ppo_clip_loss(_logp(params, batch), batch["old_logp"], batch["adv"],
                               mask=batch["mask"], token_level=False, denominator=num_documents)
    return loss, {"tokens": m["num_tokens"]}

  mbs = [_micro_batch(2, 30), _micro_batch(3, 31)]
  params = _params(3, jnp.bfloat16)
  trainer = Trainer(aux_loss, optax.sgd(0.1), count_documents=count_documents, micro_batches=2,
                    has_aux=True)
  state, metrics = trainer.step(trainer.init(params), iter(mbs))
  assert float(metrics["aux"]["tokens"]) == sum(b["mask"].sum() for b in mbs)
  assert state.params["w"].dtype == jnp.bfloat16
  assert not np.array_equal(np.asarray(state.params["w"], np.float32),
                            np.asarray(params["w"], np.float32))


def test_static_mode_partial_last_step_and_errors():
  trainer = Trainer(loss_fn, optax.sgd(0.1), count_documents=count_documents, micro_batches=3)
  pulled, n = trainer.pull(iter([_micro_batch(2, 40)]))
  assert len(pulled) == 1 and n == 2
  with pytest.raises(StopIteration):
    trainer.pull(iter([]))
  with pytest.raises(ValueError, match="Trainer: docs_per_step must be >= 0, got -1"):
    Trainer(loss_fn, optax.sgd(0.1), count_documents=count_documents, docs_per_step=-1)
  with pytest.raises(ValueError, match="Trainer: micro_batches must be >= 1, got 0"):
    Trainer(loss_fn, optax.sgd(0.1), count_documents=count_documents, micro_batches=0)
  # A flag or a float where a count belongs is a named TypeError, never a silent 1.
  for kwargs in (dict(docs_per_step=True), dict(micro_batches=2.0)):
    with pytest.raises(TypeError, match="Trainer: .* must be an integer"):
      Trainer(loss_fn, optax.sgd(0.1), count_documents=count_documents, **kwargs)
  with pytest.raises(TypeError, match="Trainer: has_aux must be a Python bool"):
    Trainer(loss_fn, optax.sgd(0.1), count_documents=count_documents, has_aux=1)
  with pytest.raises(TypeError, match="Trainer: batch_sharding must be a jax.sharding.Sharding"):
    Trainer(loss_fn, optax.sgd(0.1), count_documents=count_documents, batch_sharding="data")
  # count_documents may answer with a 0-d integer array; a fraction is an error.
  t = Trainer(loss_fn, optax.sgd(0.1), count_documents=lambda b: jnp.sum(b["mask"].any(-1)),
              docs_per_step=1)
  assert t.pull(iter([_micro_batch(2, 41)]))[1] == 2
  t = Trainer(loss_fn, optax.sgd(0.1), count_documents=lambda b: 2.5, docs_per_step=1)
  with pytest.raises(TypeError, match=r"Trainer.pull: count_documents\(batch\) must be an "
                                      r"integer, got 2.5"):
    t.pull(iter([_micro_batch(2, 42)]))


def _mesh2():
  if len(jax.devices()) < 2:
    pytest.skip(f"needs 2 devices, JAX sees {len(jax.devices())}")
  return Mesh(np.array(jax.devices()[:2]), ("data",))


@pytest.mark.parametrize("docs_per_step", [0, 6])
def test_two_device_data_mesh(docs_per_step):
  mesh = _mesh2()
  params = _params(4)
  mbs = [_micro_batch(2, 50), _micro_batch(4, 51, empty_rows=(3,)), _micro_batch(2, 52)]
  trainer = Trainer(loss_fn, optax.sgd(0.1), count_documents=count_documents,
                    docs_per_step=docs_per_step, micro_batches=3,
                    batch_sharding=NamedSharding(mesh, P("data")))
  state = trainer.init(params)
  assert len(state.params["w"].sharding.device_set) == 2
  placed = trainer._place(mbs[1])
  assert placed["x"].sharding.spec == P("data") and len(placed["x"].sharding.device_set) == 2
  pulled, n = trainer.pull(iter(mbs))
  assert n == 7 and len(pulled) == 3
  grads, _, _ = trainer.gradients(state.params, pulled, n)
  _assert_grads_close(grads, _one_batch_grad(params, mbs))  # unsharded, one device


def test_two_device_mesh_with_shard_map_loss_and_global_reductions():
  """A loss written per device (shard_map) with global denominators over 'data'."""
  mesh = _mesh2()

  def per_device(params, batch, num_documents):
    loss, _ = rl.ppo_clip_loss(_logp(params, batch), batch["old_logp"], batch["adv"],
                               mask=batch["mask"], token_level=False, axis_names="data",
                               denominator=num_documents)
    return loss

  sm_loss = shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=P())
  params = _params(5)
  mbs = [_micro_batch(2, 60), _micro_batch(6, 61, empty_rows=(0, 5)), _micro_batch(4, 62)]
  trainer = Trainer(sm_loss, optax.sgd(0.1), count_documents=count_documents, docs_per_step=6,
                    batch_sharding=NamedSharding(mesh, P("data")))
  state = trainer.init(params)
  state2, metrics = trainer.step(state, iter(mbs))
  assert metrics["num_micro_batches"] == 2 and metrics["num_documents"] == 6
  want = _one_batch_grad(params, mbs[:2])
  for k in params:
    expect = np.asarray(params[k], np.float64) - 0.1 * np.asarray(want[k], np.float64)
    assert rel_err(state2.params[k], expect) <= ACC_TOL
  assert isinstance(state2, TrainState)
