"""Documents.gather / Documents.scatter: the aligned attention's data movement, and its
gradients (inverse gathers, no scatter-add) against autodiff of the plain indexing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bitwise_equal

from jaxrl_kernels.nn.protocol import documents

# Row 0: two packed documents, then padding. Row 1: left padding, a document, then one
# that starts at position 3 (a "bad" document: its tokens' outputs are NaN).
POSITIONS = np.array([[0, 1, 2, 3, 4, 0, 1, 2, -1, -1],
                      [-1, 0, 1, 2, 3, 4, 5, 3, 4, 5]], np.int32)
SEGMENTS = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 0, 0],
                     [0, 3, 3, 3, 3, 3, 3, 4, 4, 4]], np.int32)


def _plain_gather(docs, x):
  t = x.shape[1]
  j = jnp.arange(t)
  cols = jnp.clip(docs.col0[:, None] + j, 0, t - 1)
  keep = (j < docs.length[:, None])[..., None]
  return jnp.where(keep, x[docs.row[:, None], cols], 0)


def _plain_scatter(docs, y):
  out = jnp.where(docs.live[..., None], y[docs.doc, docs.slot], 0)
  return jnp.where(docs.bad[..., None], jnp.nan, out)


@pytest.mark.parametrize("max_docs", [6, 3])  # 3: the fourth document is past max_docs
def test_moves_and_their_gradients_match_autodiff_of_plain_indexing(max_docs):
  # Traced positions: documents() skips its eager layout checks, so the bad document stays.
  docs = jax.jit(lambda p, s: documents(p, s, max_docs))(POSITIONS, SEGMENTS)
  assert bool(jnp.any(docs.bad)), "the layout must hold a bad document"
  x = jax.random.normal(jax.random.key(0), (2, 10, 3))
  y = jax.random.normal(jax.random.key(1), (max_docs, 10, 3))
  dy = jax.random.normal(jax.random.key(2), (max_docs, 10, 3))
  dz = jax.random.normal(jax.random.key(3), (2, 10, 3))
  for name, op, plain, arg, cot in (("gather", docs.gather, _plain_gather, x, dy),
                                    ("scatter", docs.scatter, _plain_scatter, y, dz)):
    got, vjp = jax.vjp(op, arg)
    want, vjp_plain = jax.vjp(lambda a, plain=plain: plain(docs, a), arg)
    assert_bitwise_equal(got, want, f"{name} forward")
    # Values equal (autodiff's scatter-add may turn a -0 cotangent into +0).
    g, g_plain = vjp(cot)[0], vjp_plain(cot)[0]
    assert np.array_equal(np.asarray(g), np.asarray(g_plain)), f"{name} gradient"
    assert np.any(np.asarray(g) != 0), f"{name} gradient is all zeros"


def test_gradient_runs_no_scatter():
  docs = jax.jit(lambda p, s: documents(p, s, 4))(POSITIONS, SEGMENTS)
  x = jnp.ones((2, 10, 3))

  def loss(x):
    return jnp.sum(jnp.nan_to_num(docs.scatter(2.0 * docs.gather(x))))

  hlo = jax.jit(jax.grad(loss)).lower(x).as_text()
  assert "scatter" not in hlo
  plain = jax.jit(jax.grad(lambda x: jnp.sum(jnp.nan_to_num(
      _plain_scatter(docs, 2.0 * _plain_gather(docs, x)))))).lower(x).as_text()
  assert "scatter" in plain  # the control: autodiff of the indexing scatters
