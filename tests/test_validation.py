"""The shared argument-validation layer: every accepted form, every rejected one, with messages
that name the op and the argument; concrete values checked exactly before any cast, traced
values through ``checkify`` (no-op under plain ``jit``, an error under ``checkify.checkify``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jaxrl_kernels import _validation as v


def _checkified(f, *args):
  """Runs ``jit(f)`` under checkify; returns the error message or None."""
  err, _ = checkify.checkify(jax.jit(f))(*args)
  return err.get()


def test_is_concrete():
  assert v.is_concrete(jnp.ones(2), np.ones(2), None, 3)
  seen = []
  jax.jit(lambda x: seen.append(v.is_concrete(x, None)) or x)(jnp.ones(2))
  assert seen == [False]


def test_dtype_kind_maps_ml_dtypes_floats():
  assert np.dtype(jnp.bfloat16).kind == "V"  # why dtype_kind exists
  assert [v.dtype_kind(d) for d in (jnp.bfloat16, jnp.float16, np.int8, bool, np.uint32)] == [
      "f", "f", "i", "b", "u"]


@pytest.mark.parametrize("good", [True, False, np.bool_(True)])
def test_check_bool_accepts(good):
  assert v.check_bool("op", "flag", good) is bool(good)


@pytest.mark.parametrize("bad", [1, 0, 1.0, np.array(True), jnp.array(True), "True", None])
def test_check_bool_rejects(bad):
  with pytest.raises(TypeError, match=r"^op: flag must be a Python bool, got "):
    v.check_bool("op", "flag", bad)


def test_check_choice():
  assert v.check_choice("pad_vocab", "weight_layout", "HV", ("VH", "HV")) == "HV"
  for bad in ("hv", "", None, 3, ("VH",)):
    with pytest.raises(ValueError, match=r"pad_vocab: weight_layout must be one of "
                                         r"\('VH', 'HV'\), got"):
      v.check_choice("pad_vocab", "weight_layout", bad, ("VH", "HV"))


@pytest.mark.parametrize("mask", [
    [True, False, True],
    [1, 0, 1],
    [1.0, 0.0, 1.0],
    np.array([1, 0, 1], np.uint8),
    jnp.array([1, 0, 1], jnp.bfloat16),
    jnp.array([True, False, True]),
])
def test_as_mask_accepts_bool_and_exact_0_1(mask):
  out = v.as_mask("op", "mask", mask, (3,))
  assert isinstance(out, jax.Array) and out.dtype == jnp.bool_
  np.testing.assert_array_equal(out, [True, False, True])


def test_as_mask_none_empty_and_unchecked_shape():
  assert v.as_mask("op", "mask", None, (3,)) is None
  out = v.as_mask("op", "mask", [], (0,))
  assert out.dtype == jnp.bool_ and out.shape == (0,)
  assert v.as_mask("op", "mask", [[1, 0]], None).shape == (1, 2)
  assert v.as_mask("op", "mask", [], (0, 4)).shape == (0, 4)  # a list cannot spell (0, 4)
  assert v.as_ids("op", "ids", [], shape=(0, 4)).shape == (0, 4)


@pytest.mark.parametrize("mask, value, index", [
    ([1, 0, 2], "2", "2"),
    ([1.0, 0.5, 1.0], "0.5", "1"),
    ([[1.0, 0.0], [np.nan, 1.0]], "nan", r"\(1, 0\)"),
    ([1, -1, 0], "-1", "1"),
])
def test_as_mask_rejects_values_other_than_0_1_naming_the_first(mask, value, index):
  shape = np.shape(mask)
  with pytest.raises(ValueError, match=rf"^op: mask must be bool or hold only 0 and 1, got "
                                       rf"{value} at index {index}$"):
    v.as_mask("op", "mask", mask, shape)


def test_as_mask_shape_and_dtype_errors():
  with pytest.raises(ValueError, match=r"op: mask must have shape \(2, 3\), got \(3,\)"):
    v.as_mask("op", "mask", [True, False, True], (2, 3))
  with pytest.raises(TypeError, match="op: mask must have a bool, integer or float dtype"):
    v.as_mask("op", "mask", np.array([1j, 0]), (2,))
  with pytest.raises(TypeError, match="op: mask must have a bool, integer or float dtype"):
    v.as_mask("op", "mask", ["a", "b"], (2,))
  with pytest.raises(TypeError, match="op: mask must be an array, got str"):
    v.as_mask("op", "mask", "all", (2,))
  with pytest.raises(TypeError, match="op: mask must be an array, got list that numpy cannot"):
    v.as_mask("op", "mask", [[1, 0], [1]], (2,))


def test_as_mask_traced():
  f = lambda m: v.as_mask("op", "mask", m, (3,))  # noqa: E731
  np.testing.assert_array_equal(jax.jit(f)(jnp.array([1.0, 0.0, 1.0])), [True, False, True])
  assert _checkified(f, jnp.array([1.0, 0.0, 1.0])) is None
  msg = _checkified(f, jnp.array([1.0, 0.0, 0.5]))
  assert msg is not None and "op: mask must hold only 0 and 1" in msg
  # A bool tracer needs no check and stays as it is.
  assert _checkified(f, jnp.array([True, False, True])) is None


def test_as_mask_keeps_a_sharded_mask_sharded():
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  m = jax.device_put(jnp.array([1, 0, 1, 1], jnp.int32), sh)
  out = v.as_mask("op", "mask", m, (4,))
  assert out.sharding.is_equivalent_to(sh, 1)


@pytest.mark.parametrize("ids", [[0, 5, 2**31 - 1], np.array([0, 5, 2**31 - 1], np.int64),
                                 np.array([0, 5, 2**31 - 1], np.uint32),
                                 jnp.array([0, 5, 2**31 - 1]), (0, 5, 2**31 - 1)])
def test_as_ids_accepts_integers_that_fit(ids):
  out = v.as_ids("op", "targets", ids)
  assert out.dtype == jnp.int32
  np.testing.assert_array_equal(out, [0, 5, 2**31 - 1])


@pytest.mark.parametrize("ids, value, index", [
    ([1, 2, 3, 2**32 + 5], 2**32 + 5, "3"),         # would wrap to 5
    ([1, 2**32 + 300], 2**32 + 300, "1"),           # would wrap to 300
    ([0, -(2**31) - 1], -(2**31) - 1, "1"),
    (np.array([[0, 1], [2**40, 2]], np.int64), 2**40, r"\(1, 0\)"),
    (np.array([7, 2**31], np.uint32), 2**31, "1"),
    (np.array([7, 2**63], np.uint64), 2**63, "1"),
    ([3, 2**70], 2**70, "1"),                       # beyond int64: an object array
])
def test_as_ids_refuses_values_outside_int32_before_the_cast(ids, value, index):
  with pytest.raises(ValueError, match=rf"^op: targets must fit int32, got {value} at index "
                                       rf"{index}$"):
    v.as_ids("op", "targets", ids)


@pytest.mark.parametrize("ids, dtype", [([0.5, 3.7], "float64"), ([0.0, 3.0], "float64"),
                                        ([True, False], "bool"),
                                        (jnp.array([1.0, 2.0]), "float32")])
def test_as_ids_refuses_float_and_bool(ids, dtype):
  with pytest.raises(TypeError, match=rf"^op: targets must have an integer dtype, got {dtype}$"):
    v.as_ids("op", "targets", ids)


def test_as_ids_shape_empty_and_junk():
  assert v.as_ids("op", "targets", []).shape == (0,)
  assert v.as_ids("op", "targets", [], shape=(0,)).dtype == jnp.int32
  with pytest.raises(ValueError, match=r"op: targets must have shape \(4,\), got \(3,\)"):
    v.as_ids("op", "targets", [1, 2, 3], shape=(4,))
  with pytest.raises(TypeError, match="op: targets must hold integer ids, got 'a'"):
    v.as_ids("op", "targets", np.array([1, "a", 2**70], object))
  with pytest.raises(TypeError, match="op: targets must be an array, got NoneType"):
    v.as_ids("op", "targets", None)


def test_as_ids_traced():
  out = jax.jit(lambda t: v.as_ids("op", "targets", t))(jnp.array([1, 2], jnp.uint8))
  assert out.dtype == jnp.int32
  np.testing.assert_array_equal(out, [1, 2])
  with pytest.raises(TypeError, match="op: targets must have an integer dtype, got float32"):
    jax.jit(lambda t: v.as_ids("op", "targets", t))(jnp.array([1.0]))
  f = lambda t: v.as_ids("op", "targets", t)  # noqa: E731
  assert _checkified(f, jnp.array([1, 2], jnp.uint32)) is None
  msg = _checkified(f, jnp.array([1, 2**31], jnp.uint32))
  assert msg is not None and "op: targets must fit int32" in msg


def test_check_ids_in_range_concrete():
  v.check_ids_in_range("op", "targets", jnp.array([0, 3, -100]), 4,
                       mask=jnp.array([True, True, False]))
  with pytest.raises(ValueError, match=r"^op: targets must lie in \[0, 4\), got 7 at index 1 "
                                       r"\(2 id\(s\) out of range\)$"):
    v.check_ids_in_range("op", "targets", np.array([0, 7, -1]), 4)
  with pytest.raises(ValueError, match=r"got -100 at index \(0, 2\)"):
    v.check_ids_in_range("op", "targets", np.array([[0, 3, -100]]), 4)
  with pytest.raises(TypeError, match="op: vocab_size must be an integer, got 4.0"):
    v.check_ids_in_range("op", "targets", np.array([0]), 4.0)


def test_check_ids_in_range_traced():
  f = lambda t, m: v.check_ids_in_range("op", "targets", t, 4, mask=m)  # noqa: E731
  assert _checkified(f, jnp.array([0, 9]), jnp.array([True, False])) is None
  msg = _checkified(f, jnp.array([0, 9]), jnp.array([True, True]))
  assert msg is not None and "op: 1 targets id(s) outside [0, 4)" in msg
  jax.jit(f)(jnp.array([0, 9]), jnp.array([True, True]))  # plain jit: no error, no crash


@pytest.mark.parametrize("dtype, name", [("bfloat16", "bfloat16"), (jnp.float16, "float16"),
                                         (np.float32, "float32"), (jnp.dtype("float32"),
                                                                   "float32")])
def test_as_float_dtype_accepts(dtype, name):
  assert v.as_float_dtype("det_matmul", "out_dtype", dtype) == jnp.dtype(name)


@pytest.mark.parametrize("bad", ["nonsense", None, True, "int32", jnp.int8, float, "float64",
                                 object()])
def test_as_float_dtype_rejects_with_its_own_message(bad):
  with pytest.raises(TypeError, match=r"^det_matmul: out_dtype must be one of \('bfloat16', "
                                      r"'float16', 'float32'\), got "):
    v.as_float_dtype("det_matmul", "out_dtype", bad)
  assert v.as_float_dtype("op", "x", "float64", allowed=("float64",)) == jnp.float64


def test_check_float_array():
  v.check_float_array("op", "hidden", jnp.ones(2, jnp.bfloat16))
  v.check_float_array("op", "hidden", np.ones(2, np.float32))
  with pytest.raises(TypeError, match=r"op: hidden must have dtype in \('bfloat16', 'float16', "
                                      r"'float32'\), got int32"):
    v.check_float_array("op", "hidden", jnp.ones(2, jnp.int32))
  with pytest.raises(TypeError, match="op: hidden must be a jax or numpy array, got list"):
    v.check_float_array("op", "hidden", [1.0, 2.0])
  jax.jit(lambda x: v.check_float_array("op", "hidden", x))(jnp.ones(2))


@pytest.mark.parametrize("value", [2, 2.5, np.float32(2.5), np.int64(2), np.array(2.5),
                                   jnp.array(2.5), jnp.array(2, jnp.int32)])
def test_as_scalar_concrete(value):
  out = v.as_scalar("linear_logp", "temperature", value, positive=True)
  assert type(out) is float and out == float(np.asarray(value))


@pytest.mark.parametrize("bad, exc, msg", [
    (True, TypeError, "must be a real number, got True"),
    (np.bool_(False), TypeError, "must be a real number"),
    ("1.0", TypeError, "must be a real number, got '1.0'"),
    (None, TypeError, "must be a real number, got None"),
    (1 + 2j, TypeError, "must be a real number"),
    (np.array([1.0, 2.0]), TypeError, r"must be a scalar, got an array of shape \(2,\)"),
    (jnp.ones((1,)), TypeError, r"must be a scalar, got an array of shape \(1,\)"),
    (np.array(True), TypeError, "must be a real number, got dtype bool"),
    (float("nan"), ValueError, "must be finite, got nan"),
    (np.float32("inf"), ValueError, "must be finite, got inf"),
    (0.0, ValueError, r"must be > 0, got 0.0"),
    (-1, ValueError, r"must be > 0, got -1.0"),
])
def test_as_scalar_rejects(bad, exc, msg):
  with pytest.raises(exc, match=rf"^linear_logp: temperature {msg}"):
    v.as_scalar("linear_logp", "temperature", bad, positive=True)


def test_as_scalar_traced():
  out = jax.jit(lambda t: v.as_scalar("op", "clip_low", t))(jnp.bfloat16(0.25))
  assert out.dtype == jnp.float32 and float(out) == 0.25
  with pytest.raises(TypeError, match="op: clip_low must be a concrete number, got a traced "
                                      "value"):
    jax.jit(lambda t: v.as_scalar("op", "clip_low", t, allow_traced=False))(0.2)
  with pytest.raises(TypeError, match=r"op: clip_low must be a scalar, got an array of shape"):
    jax.jit(lambda t: v.as_scalar("op", "clip_low", t))(jnp.ones(2))
  f = lambda t: v.as_scalar("op", "temperature", t, positive=True)  # noqa: E731
  assert _checkified(f, jnp.float32(1.0)) is None
  assert "op: temperature must be > 0" in _checkified(f, jnp.float32(-1.0))


def test_check_int():
  assert v.check_int("op", "vocab_size", np.int64(8), minimum=1) == 8
  assert type(v.check_int("op", "vocab_size", np.int64(8))) is int
  for bad in (8.0, True, np.bool_(True), "8", None, np.array(8), jnp.array(8)):
    with pytest.raises(TypeError, match=r"^op: vocab_size must be an integer, got "):
      v.check_int("op", "vocab_size", bad)
  with pytest.raises(ValueError, match=r"^op: vocab_size must be >= 1, got 0$"):
    v.check_int("op", "vocab_size", 0, minimum=1)
