"""Sharded whole models (models.shard): every (tp, fsdp, dp) layout on the 8-device host mesh
gives the unsharded DecoderLM's hidden states and log-probs bit for bit; the Megatron psum
layers do not; the sampler at TP = 2 equals the trainer under FSDP and unsharded; FSDP/DP
gradients equal the unsharded ones within tolerance, run to run bitwise; bad layouts give
errors naming the argument."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TOL, assert_bitwise_equal, assert_sharded_gradients_match, rel_err

from jaxrl_kernels import models
from jaxrl_kernels.models.config import DecoderConfig
from jaxrl_kernels.nn.sampler import sample, score

V = 1000  # not a multiple of the vocab tile: padded to 1024 at TP = 2, 4, 8
B, T = 8, 12


def _config(**over) -> DecoderConfig:
  # Biases on every projection (o and down included), q/k norm, a tied head: every kind of
  # parameter the sharding rule places. 16 query heads in 8 GQA groups of 2.
  base = dict(model_type="llama", vocab_size=V, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8, head_dim=16,
              attention_bias=True, mlp_bias=True, qk_norm=True, tie_word_embeddings=True)
  return DecoderConfig(**{**base, **over})


def _model(cfg: DecoderConfig, dtype="float32", seed=0) -> models.DecoderLM:
  """Random weights that reveal a reordering: the K rows of o_proj / down_proj scaled by
  2**e, e in [-6, 6] (partial sums of very different sizes), non-zero biases, unit-scale
  embeddings and norm weights around 1."""
  model = models.DecoderLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    x = np.asarray(var.get_value(), np.float32)
    name = ".".join(map(str, path))
    if name.endswith(("o_proj.kernel", "down_proj.kernel")):
      x = x * np.exp2(rng.integers(-6, 7, (x.shape[0], 1)))
    elif name.endswith("bias"):
      x = rng.standard_normal(x.shape) * 0.5
    elif name.endswith("embedding"):
      x = rng.standard_normal(x.shape)
    elif x.ndim == 1:
      x = 1.0 + 0.2 * rng.standard_normal(x.shape)
    var.set_value(jnp.asarray(x, var.get_value().dtype))
  return model


def _mesh(tp: int, fsdp: int, dp: int, *, explicit: bool = False):
  """A ``Mesh`` of the first devices (Auto axes), or ``jax.make_mesh``'s (Explicit axes:
  arrays carry their layout in their type)."""
  if explicit:
    mesh = jax.make_mesh((tp, fsdp, dp), ("tp", "fsdp", "dp"))
  else:
    devices = np.array(jax.devices()[:tp * fsdp * dp]).reshape(tp, fsdp, dp)
    mesh = jax.sharding.Mesh(devices, ("tp", "fsdp", "dp"))
  return models.Parallelism(mesh, tp="tp", fsdp="fsdp", dp="dp")


def _tokens(seed=1):
  rng = np.random.default_rng(seed)
  tok = rng.integers(0, V, (B, T)).astype(np.int32)
  return tok, np.roll(tok, -1, axis=1)


def _packed():
  """3 documents of 4 tokens per row (segment ids, restarting positions), row 1 left-padded,
  a mask: the layout a trainer packs."""
  seg = np.repeat(np.arange(3)[None], B, 0).repeat(4, axis=1).astype(np.int32)
  pos = np.tile(np.arange(4), (B, 3)).astype(np.int32)
  pos[1, :4] = [-1, -1, 0, 1]  # a document of 2 tokens behind 2 pads
  mask = np.random.default_rng(3).random((B, T)) < 0.8
  return pos, seg, mask


@nnx.jit
def _forward(m, tokens, targets, positions, segment_ids, mask):
  """Hidden states of packed rows, and the head's log-probs and entropies of them at a
  temperature (``m.logp`` is ``m.head(m(...), ...)``)."""
  h = m(tokens, positions, segment_ids, max_docs=3 * B)
  lp, ent = m.head(h, targets, mask, temperature=0.7, return_entropy=True)
  return h, lp, ent


@pytest.fixture(scope="module")
def f32():
  model = _model(_config())
  tok, tg = _tokens()
  inputs = (tok, tg, *_packed())
  return model, inputs, _forward(model, *inputs)


# tp, fsdp, dp in {1, 2, 4, 8} with tp * fsdp * dp <= 8: 20 layouts. CI runs eight that
# reach every axis and every code path: the tp code path on one device, each axis alone at 8
# (the largest tp), each pair at a product of 8, and all three at 2 on a jax.make_mesh mesh
# (Explicit axes). The slow test runs the other twelve. Each layout compiles one program.
PAIRINGS = [p for p in itertools.product((1, 2, 4, 8), repeat=3) if np.prod(p) <= 8]
# In CI: each axis alone at its largest degree and all three mixed (the rest: slow).
CI_PAIRINGS = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2)]


def _check_pairings(f32, pairings):
  model, inputs, ref = f32
  for tp, fsdp, dp in pairings:
    mesh = _mesh(tp, fsdp, dp, explicit=(tp, fsdp, dp) == (2, 2, 2))
    got = _forward(models.shard(model, mesh), *inputs)
    for name, a, b in zip(("hidden", "logp", "entropy"), got, ref, strict=True):
      assert_bitwise_equal(a, b, f"tp={tp} fsdp={fsdp} dp={dp} {name}")
  assert np.all(np.asarray(ref[1])[~inputs[-1]] == 0)


def test_pairings_bitwise(f32):
  """Hidden states, log-probs and entropies (packed rows, mask, temperature): the unsharded
  model's bits."""
  _check_pairings(f32, CI_PAIRINGS)


@pytest.mark.slow
def test_every_other_pairing_bitwise(f32):
  assert len(PAIRINGS) == 20 and set(CI_PAIRINGS) <= set(PAIRINGS)
  _check_pairings(f32, [p for p in PAIRINGS if p not in CI_PAIRINGS])


def test_psum_layers_change_bits(f32):
  """The control: the same TP model with Megatron psum row-parallel layers (and the head's
  per-shard softmax merge) is not the unsharded model's bits."""
  model, inputs, ref = f32
  got = _forward(models.shard(model, _mesh(8, 1, 1), merge="psum"), *inputs)
  real = inputs[2] >= 0  # padding positions hold NaN hidden states in both
  a, b = np.asarray(got[0])[real], np.asarray(ref[0])[real]
  assert not np.array_equal(a, b)
  # ... while it computes the same function (CONTRACT section 2).
  assert rel_err(a, b) < TOL["float32"][0]


@pytest.mark.slow
def test_bfloat16_untied_head_bitwise():
  """bfloat16 activations and an untied [H, V] head at TP = 2 x FSDP = 2 x DP = 2 and TP = 8."""
  model = _model(_config(tie_word_embeddings=False, qk_norm=False), dtype="bfloat16", seed=4)
  inputs = (*_tokens(5), *_packed())
  ref = _forward(model, *inputs)
  for layout in ((2, 2, 2), (8, 1, 1)):
    got = _forward(models.shard(model, _mesh(*layout)), *inputs)
    for name, a, b in zip(("hidden", "logp", "entropy"), got, ref, strict=True):
      assert_bitwise_equal(a, b, f"bf16 {layout} {name}")


def test_sampler_tp_equals_trainer_fsdp_and_unsharded(f32):
  """Sampled at TP = 2 (KV cache split over kv heads, logits and statistics from the
  vocab-parallel head), scored at FSDP = 2 x DP = 2 packed and by the unsharded model:
  every sampled token's log-prob, bit for bit."""
  model = f32[0]
  rng = np.random.default_rng(7)
  prompts = rng.integers(0, V, (4, 6)).astype(np.int32)
  lens = np.array([6, 2, 5, 3], np.int32)
  res = sample(models.shard(model, _mesh(2, 1, 2)), prompts, lens, max_new_tokens=5,
               key=jax.random.key(3), temperature=0.9, top_k=50)
  m = np.asarray(res.completion_mask)
  lp = np.asarray(res.logp)
  assert m.sum() == 4 * 5 and np.all(np.isfinite(lp)) and np.all(lp[m] <= 0)
  trainer = score(models.shard(model, _mesh(1, 2, 2)), res.tokens, res.completion_mask,
                  temperature=0.9, pack=True, batch_size=4)
  assert_bitwise_equal(trainer, lp, "sampler TP=2 vs trainer FSDP=2")
  assert_bitwise_equal(score(model, res.tokens, res.completion_mask, temperature=0.9), lp,
                       "sampler TP=2 vs unsharded trainer")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [4, 1])
def test_sampler_tp_equals_unsharded_sampler(f32, tp):
  """TP = 4, and the tp code path on one device (the last tile of the vocabulary partial on
  the device): the same tokens and log-probs as the unsharded sampler with the same key."""
  model = f32[0]
  prompts = np.random.default_rng(8).integers(0, V, (2, 5)).astype(np.int32)
  lens = np.array([5, 3], np.int32)
  kw = dict(max_new_tokens=4, key=jax.random.key(9), temperature=0.8)
  ref = sample(model, prompts, lens, **kw)
  got = sample(models.shard(model, _mesh(tp, 1, 1)), prompts, lens, **kw)
  assert_bitwise_equal(got.tokens, ref.tokens, "tokens")
  assert_bitwise_equal(got.logp, ref.logp, "logp")


def test_fsdp_dp_gradients(f32):
  """jax.grad through sharded.logp at FSDP = 2 x DP = 2: the unsharded gradients within the
  float32 tolerance (the per-device sums are added across devices), and the same bits on
  every run."""
  model = f32[0]
  tok, tg = _tokens()
  mask = np.arange(T)[None, :] < np.array([[12], [7], [12], [3], [12], [12], [9], [12]])

  def loss(m):
    return -jnp.sum(m.logp(tok, tg, mask)) / mask.sum()

  assert_sharded_gradients_match(loss, model, models.shard(model, _mesh(1, 2, 2)),
                                 TOL["float32"][1])


@pytest.mark.slow
def test_fsdp_remat_gradients(f32):
  """remat=True (each layer's fsdp gathers run again in the backward pass): the same
  gradient bits as without remat."""
  model = f32[0]
  tok, tg = _tokens()
  rm = nnx.merge(*nnx.split(model))
  rm.remat = True

  def loss(m):
    return -jnp.sum(m.logp(tok, tg))

  grad = nnx.jit(nnx.grad(loss))
  ref = dict(nnx.to_flat_state(grad(models.shard(model, _mesh(1, 4, 2)))))
  got = dict(nnx.to_flat_state(grad(models.shard(rm, _mesh(1, 4, 2)))))
  assert ref.keys() == got.keys()
  for path, g in ref.items():
    assert_bitwise_equal(np.asarray(got[path].get_value()), np.asarray(g.get_value()),
                         f"remat {path}")


def test_tp_gradients_refused(f32):
  model = f32[0]
  tok, tg = _tokens()
  sharded = models.shard(model, _mesh(2, 1, 1))
  with pytest.raises(ValueError, match="tp > 1 is forward-only"):  # raised while tracing
    nnx.eval_shape(nnx.grad(lambda m: jnp.sum(m.logp(tok, tg))), sharded)


def test_bad_layouts_named_errors(f32):
  model = f32[0]
  mesh = _mesh(2, 2, 2).mesh
  with pytest.raises(ValueError, match=r"tp='x' is not an axis of the mesh"):
    models.Parallelism(mesh, tp="x")
  with pytest.raises(ValueError, match="tp and dp both name mesh axis 'tp'"):
    models.Parallelism(mesh, tp="tp", dp="tp")
  with pytest.raises(ValueError, match="mesh axis 'dp' .* has no role"):
    models.Parallelism(mesh, tp="tp", fsdp="fsdp")
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    models.Parallelism("mesh")
  with pytest.raises(TypeError, match="model must be a DecoderLM"):
    models.shard(object(), _mesh(2, 1, 1))
  with pytest.raises(ValueError, match="tp=8 must divide num_key_value_heads=4"):
    models.shard(models.DecoderLM(_config(num_key_value_heads=4), rngs=nnx.Rngs(0)),
                 _mesh(8, 1, 1))
  with pytest.raises(ValueError, match="row_chunks=1 .* runs with tp = 1 only, got tp=2"):
    models.shard(models.DecoderLM(_config(), row_chunks=1, rngs=nnx.Rngs(0)), _mesh(2, 1, 1))
  with pytest.raises(ValueError, match=r"tp=4 must divide the model's row-parallel K chunks "
                     r"\(o_proj 2, down_proj 2; row_chunks=2\)"):
    models.shard(models.DecoderLM(_config(), row_chunks=2, rngs=nnx.Rngs(0)), _mesh(4, 1, 1))
  with pytest.raises(ValueError, match="vocab_size=300 is too small for tp=4"):
    models.shard(models.DecoderLM(_config(vocab_size=300), rngs=nnx.Rngs(0)), _mesh(4, 1, 1))
  with pytest.raises(ValueError, match="implementation='xla' .* has no vocab-parallel head"):
    models.shard(models.DecoderLM(_config(), implementation="xla", rngs=nnx.Rngs(0)),
                 _mesh(2, 1, 1))
  with pytest.raises(ValueError, match="merge must be one of"):
    models.shard(model, _mesh(2, 1, 1), merge="tree")
  sharded = models.shard(model, _mesh(1, 2, 2))
  with pytest.raises(ValueError, match=r"batch dimension of tokens is 6, .* dp x fsdp = 4"):
    sharded(np.zeros((6, 4), np.int32))
  with pytest.raises(ValueError, match=r"batch dimension of the cache is 2, .* dp x fsdp = 4"):
    sharded.init_cache(2, 8)
  with pytest.raises(ValueError, match="row_chunks must be None or a power of two"):
    models.DecoderLM(_config(), row_chunks=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="row_chunks=256 must divide the intermediate_size"):
    models.DecoderLM(_config(), row_chunks=256, rngs=nnx.Rngs(0))


def test_canonical_row_chunks():
  """Per layer the most chunks (at most 8) of whole 64-column K tiles, never fewer than the
  model's largest TP degree gcd(8, kv heads); without whole tiles, the most that divide K."""
  rule = models.canonical_row_chunks
  assert rule(models.config("qwen2.5-0.5b")) == (2, 4)  # 896 / 2 = 448, 4864 / 4 = 1216
  assert rule(models.config("qwen2.5-1.5b")) == (8, 4)  # 1536 / 8 = 192, 8960 / 4 = 2240
  assert rule(models.config("llama-3.2-1b")) == (8, 8)
  # 8 kv heads: at least 8 chunks, though 128 / 8 = 16 columns are not whole tiles.
  assert rule(_config()) == (8, 8)
  # 2 kv heads: o_proj 128 -> 2 chunks of 64, down_proj 256 -> 4 chunks of 64.
  assert rule(_config(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=256)) == (2, 4)
  # 4 kv heads and no count in [4, 8] of whole tiles: the most that divide K.
  assert rule(_config(num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                      intermediate_size=96)) == (8, 8)
  with pytest.raises(ValueError, match=r"intermediate_size of down_proj \(100\) is not a "
                     r"multiple of 8"):
    rule(_config(intermediate_size=100))
  m = models.DecoderLM(_config(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               intermediate_size=256), rngs=nnx.Rngs(0))
  assert m.row_chunks is None and m.row_parallel_chunks == (2, 4)
  assert [(lay.self_attn.o_proj.chunks, lay.mlp.down_proj.chunks) for lay in m.layers] == [
      (2, 4)] * 2
  m = models.DecoderLM(_config(), row_chunks=4, rngs=nnx.Rngs(0))
  assert m.row_parallel_chunks == (4, 4) and m.layers[0].mlp.down_proj.chunks == 4


def test_unequal_default_chunks_tp2_bitwise():
  """A model whose default chunks differ by layer (o_proj 2, down_proj 4): TP = 2 gives the
  unsharded bits, and TP = 4 is refused (it would need 4 o_proj chunks)."""
  cfg = _config(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                intermediate_size=256)
  model = _model(cfg)
  assert model.row_parallel_chunks == (2, 4)
  inputs = (*_tokens(2), *_packed())
  ref = _forward(model, *inputs)
  got = _forward(models.shard(model, _mesh(2, 1, 1)), *inputs)
  for name, a, b in zip(("hidden", "logp", "entropy"), got, ref, strict=True):
    assert_bitwise_equal(a, b, f"tp=2 {name}")
  # Decode (the row-parallel partials summed in the norm, the sampler's chunk weights) too:
  # sampled at TP = 2, scored by the unsharded model.
  prompts = np.random.default_rng(8).integers(0, V, (2, 5)).astype(np.int32)
  res = sample(models.shard(model, _mesh(2, 1, 1)), prompts, np.array([5, 3], np.int32),
               max_new_tokens=4, key=jax.random.key(1), temperature=0.9)
  assert np.asarray(res.completion_mask).sum() == 2 * 4
  assert_bitwise_equal(score(model, res.tokens, res.completion_mask, temperature=0.9),
                       np.asarray(res.logp), "sampler TP=2 vs unsharded trainer")
  with pytest.raises(ValueError, match="tp=4 must divide num_key_value_heads=2"):
    models.shard(model, _mesh(4, 1, 1))


def test_placement_and_model_untouched(f32):
  """Parameters live on the mesh as documented (tp over heads / MLP columns / vocabulary,
  fsdp over the first other dimension it divides), the vocabulary is padded only for tp,
  and the caller's model keeps its arrays."""
  model = f32[0]
  sharded = models.shard(model, _mesh(2, 4, 1))
  state = dict(nnx.to_flat_state(nnx.state(sharded.decoder, nnx.Param)))
  spec = {p: tuple(v.get_value().sharding.spec) for p, v in state.items()}
  assert spec[("embed_tokens", "embedding")] == ("tp", "fsdp")
  assert state[("embed_tokens", "embedding")].get_value().shape == (1024, 64)
  assert spec[("layers", 0, "self_attn", "qkv_proj", "kernel")] == ("fsdp", "tp")
  assert spec[("layers", 0, "self_attn", "o_proj", "kernel")] == ("tp", "fsdp")
  assert spec[("layers", 0, "mlp", "down_proj", "bias")] == ("fsdp",)
  assert spec[("layers", 0, "self_attn", "k_norm", "weight")] == ("fsdp",)
  assert model.embed_tokens.embedding.get_value().shape == (V, 64)
  assert "tp_dim" not in model.embed_tokens.embedding.get_metadata()
  # unshard: the plain model back, the same parameters bit for bit.
  back = sharded.unshard()
  assert isinstance(back, models.DecoderLM) and back.config == model.config
  assert back.head.embedding is back.embed_tokens.embedding  # still tied
  assert back.layers[0].self_attn.o_proj.axis_name is None
  ref = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  got = dict(nnx.to_flat_state(nnx.state(back, nnx.Param)))
  assert ref.keys() == got.keys()
  for path, var in ref.items():
    assert_bitwise_equal(np.asarray(got[path].get_value()), np.asarray(var.get_value()),
                         f"unshard {path}")
