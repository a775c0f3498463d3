"""logprob_drift: every field against a direct numpy computation, worst-token location."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_kernels.diagnostics import DriftReport, logprob_drift


def _pair(seed=0, shape=(3, 5, 4), scale=0.05):
  rng = np.random.default_rng(seed)
  ref = (rng.normal(size=shape) - 3).astype(np.float32)
  cand = (ref + scale * rng.normal(size=shape)).astype(np.float32)
  targets = rng.integers(0, 1000, size=shape)
  return cand, ref, targets


def test_fields_match_numpy():
  cand, ref, targets = _pair()
  cand[0, 1, 2] = ref[0, 1, 2] + 0.5  # the worst active token
  cand[2, 4, 3] = ref[2, 4, 3] - 2.0  # larger, but masked
  mask = np.ones(cand.shape, bool)
  mask[2, 4, 3] = False
  mask[1, 0] = False
  rep = logprob_drift(cand, ref, targets, mask)
  d = (cand.astype(np.float64) - ref)[mask]
  r = ref.astype(np.float64)[mask]
  assert rep.num_active == mask.sum()
  assert not rep.bitwise_equal
  assert rep.max_abs_error == pytest.approx(np.abs(d).max(), rel=1e-12)
  assert rep.mean_abs_error == pytest.approx(np.abs(d).mean(), rel=1e-12)
  assert rep.max_rel_error == pytest.approx((np.abs(d) / np.abs(r)).max(), rel=1e-12)
  assert rep.approx_kl0 == pytest.approx(np.mean(np.exp(d) - 1 - d), rel=1e-9)
  assert rep.clipfrac0 == pytest.approx(np.mean(np.abs(np.exp(d) - 1) > 0.2))
  assert 0 < rep.clipfrac0 < 1
  assert rep.num_nonfinite == 0
  w = rep.worst
  assert w.index == (0, 1, 2) and w.flat_index == np.ravel_multi_index((0, 1, 2), cand.shape)
  assert w.token_id == targets[0, 1, 2]
  assert w.candidate == float(cand[0, 1, 2]) and w.reference == float(ref[0, 1, 2])
  assert w.error == pytest.approx(0.5, abs=1e-6) and w.error > 0
  assert w.rank is None and w.vocab_range is None


def test_worst_token_owner_with_uneven_shards():
  cand, ref, targets = _pair(1, shape=(4, 6))
  targets[2, 3] = 617
  cand[2, 3] = ref[2, 3] - 1.0
  ranges = [(0, 300), (300, 600), (600, 700), (700, 1000)]
  rep = logprob_drift(cand, ref, targets, shard_ranges=ranges)
  assert rep.worst.rank == 2 and rep.worst.vocab_range == (600, 700)
  assert rep.worst.error < 0
  text = rep.table()
  assert "rank 2, vocab [600, 700)" in text and "617" in text
  # A token outside every range is reported as such.
  rep = logprob_drift(cand, ref, targets, shard_ranges=[(0, 300)])
  assert rep.worst.rank is None and "owned by no shard" in str(rep)


def test_bad_shard_ranges():
  cand, ref, targets = _pair(2, shape=(5,))
  with pytest.raises(ValueError, match="rank 1 starts at 50 before rank 0 ends at 100"):
    logprob_drift(cand, ref, targets, shard_ranges=[(0, 100), (50, 200)])
  with pytest.raises(ValueError, match=r"shard_ranges\[0\] must be \[start, end\)"):
    logprob_drift(cand, ref, targets, shard_ranges=[(10, 10)])


def test_bitwise_flag_sees_one_ulp():
  cand, ref, targets = _pair(3)
  assert logprob_drift(ref.copy(), ref, targets).bitwise_equal
  one_ulp = ref.copy()
  one_ulp[1, 2, 3] = np.nextafter(ref[1, 2, 3], np.float32(0))
  rep = logprob_drift(one_ulp, ref, targets)
  assert not rep.bitwise_equal and rep.max_abs_error > 0 and rep.worst.index == (1, 2, 3)
  mask = np.ones(ref.shape, bool)
  mask[1, 2, 3] = False  # the differing token masked out
  assert logprob_drift(one_ulp, ref, targets, mask).bitwise_equal
  # Different dtypes are never bitwise equal, even with equal values.
  assert not logprob_drift(ref.astype(np.float64), ref, targets).bitwise_equal


def test_nonfinite_is_the_worst_token():
  cand, ref, targets = _pair(4)
  cand[0, 0, 0] = ref[0, 0, 0] + 3.0
  cand[2, 2, 2] = np.nan
  rep = logprob_drift(cand, ref, targets)
  assert rep.num_nonfinite == 1 and rep.worst.index == (2, 2, 2)
  assert np.isnan(rep.max_abs_error)
  assert "nan" in rep.table()


def test_empty_and_jax_inputs_and_record():
  cand, ref, targets = _pair(5)
  rep = logprob_drift(jnp.asarray(cand), jnp.asarray(ref), jnp.asarray(targets),
                      jnp.zeros(cand.shape, bool))
  assert rep.num_active == 0 and rep.worst is None and rep.max_abs_error == 0.0
  assert "no active token" in str(rep)
  rep = logprob_drift(jnp.asarray(cand), jnp.asarray(ref), jnp.asarray(targets))
  assert isinstance(rep, DriftReport) and rep.num_active == cand.size
  assert str(rep) == rep.table()
  for key in ("max |d|", "mean |d|", "approx_kl0", "clipfrac0", "worst token", "token id"):
    assert key in str(rep)
  with pytest.raises(dataclasses.FrozenInstanceError):
    rep.num_active = 3


def test_shape_and_dtype_errors():
  cand, ref, targets = _pair(6)
  with pytest.raises(ValueError, match="must have the same shape"):
    logprob_drift(cand[:1], ref, targets)
  with pytest.raises(TypeError, match="logprob_drift: targets must have an integer dtype"):
    logprob_drift(cand, ref, targets.astype(np.float32))
  with pytest.raises(ValueError, match=r"mask must have shape \(3, 5, 4\)"):
    logprob_drift(cand, ref, targets, np.ones((3, 5), bool))


def test_bad_input_is_named_and_masks_accept_lists_and_0_1():
  cand, ref, targets = _pair(7)
  mask = np.ones(cand.shape, bool)
  mask[0, 0, 0] = False
  cand_g = cand.copy()
  cand_g[0, 0, 0] = np.nan  # masked: ignored
  want = logprob_drift(cand, ref, targets, mask)
  for form in (mask.astype(np.float32), mask.astype(np.int32).tolist(), jnp.asarray(mask)):
    assert logprob_drift(cand_g, ref, targets, form) == want
  bad = mask.astype(np.float32)
  bad[1, 1, 1] = 2.0
  with pytest.raises(ValueError, match=r"logprob_drift: mask must be bool or hold only 0 and 1, "
                                       r"got 2.0 at index \(1, 1, 1\)"):
    logprob_drift(cand, ref, targets, bad)
  big = targets.astype(np.int64)
  big[0, 0, 1] = 2**32 + 5
  with pytest.raises(ValueError, match=r"logprob_drift: targets must fit int32, got 4294967301"):
    logprob_drift(cand, ref, big)
  with pytest.raises(TypeError, match="logprob_drift: candidate must be a float array"):
    logprob_drift(targets, ref, targets)
  with pytest.raises(TypeError, match=r"logprob_drift: shard_ranges\[0\] must be an integer"):
    logprob_drift(cand, ref, targets, shard_ranges=[(0.0, 4.5)])
  with pytest.raises(ValueError, match=r"shard_ranges\[1\] must be a \(start, end\) pair"):
    logprob_drift(cand, ref, targets, shard_ranges=[(0, 4), (4, 5, 6)])
