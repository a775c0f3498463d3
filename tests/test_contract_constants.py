"""``jaxrl_kernels/contract.py`` is the one source of every bit-fixing constant: each value is
pinned here, the kernels use its values (no literal of their own), and the CUDA source's
K tile is checked against it. A change of bits must be deliberate: changing a constant fails
``test_today_s_values`` (and the golden digests of tests/test_golden.py)."""

import ast
import inspect
import pathlib
import re

import jax.numpy as jnp

import jaxrl_kernels
from jaxrl_kernels import _cpu, attention, contract, row_parallel_matmul
from jaxrl_kernels.attention import cpu as attention_cpu
from jaxrl_kernels.custom_calls import gemm_ffi
from jaxrl_kernels.gemm import cpu as gemm_cpu
from jaxrl_kernels.linear_logp import cpu as linear_logp_cpu
from jaxrl_kernels.linear_logp import three_gemm
from jaxrl_kernels.pallas import (
  attention_mosaic,
  attention_mosaic_bwd,
  attention_triton,
  gemm_mosaic,
  gemm_triton,
  linear_logp_bwd,
  linear_logp_fwd,
  linear_logp_mosaic,
  lm_head_logits,
  mosaic_loop,
)
from jaxrl_kernels.reduce import api as reduce_api

_PACKAGE = pathlib.Path(jaxrl_kernels.__file__).parent
_CUDA_DIR = pathlib.Path(gemm_ffi.__file__).parent

# The values the recorded results (benchmarks/results/, tests/golden_digests.json) were
# produced with. Every public name of contract.py is here: a new constant must be pinned.
TODAY = {
    "GEMM_TILE_K": 64,
    "GEMM_TRITON_BLOCK_K": {"bfloat16": 64, "float16": 64, "float32": 32},
    "VOCAB_TILE": 128,
    "LOGITS_BLOCK_H_TRITON": {"bfloat16": 64, "float16": 64, "float32": 32},
    "LOGITS_BLOCK_H_INTERPRET": 64,
    "EPI_ROWS": 64,
    "OBJECTIVE_DW_TOKEN_BLOCK": 256,
    "ROW_PARALLEL_CHUNKS": 8,
    "ATTENTION_TRITON_BLOCK_Q": 64,
    "ATTENTION_TRITON_KEY_TILE": 64,
    "ATTENTION_TRITON_FWD_NUM_WARPS": 4,
    "ATTENTION_TRITON_FWD_NUM_STAGES": 2,
    "ATTENTION_MOSAIC_BLOCK_Q": 64,
    "ATTENTION_MOSAIC_KEY_TILE": 128,
    "CPU_ROW_BLOCK": 128,
    "CPU_COL_BLOCK": 128,
    "CPU_VOCAB_CHUNK": 1024,
    "CPU_ATTENTION_BLOCK_Q": 32,
    "CPU_ATTENTION_KEY_TILE": 128,
    "REDUCE_LANES": 128,
    "GROUPED_GEMM_BLOCK_M": 64,
}

# Which contract constants each kernel file takes (``from jaxrl_kernels.contract import X``,
# ``contract.X``, or X re-exported by ``jaxrl_kernels._cpu``), relative to the package.
USES = {
    "_cpu.py": {"CPU_ROW_BLOCK"},
    "gemm/cpu.py": {"CPU_ROW_BLOCK", "CPU_COL_BLOCK"},
    "gemm/mosaic.py": {"GEMM_TILE_K"},
    "gemm/row_parallel.py": {"GEMM_TILE_K", "ROW_PARALLEL_CHUNKS"},
    "linear_logp/cpu.py": {"CPU_ROW_BLOCK", "CPU_VOCAB_CHUNK", "VOCAB_TILE"},
    "linear_logp/api.py": {"VOCAB_TILE"},
    "linear_logp/logits.py": {"VOCAB_TILE"},
    "linear_logp/three_gemm.py": {"OBJECTIVE_DW_TOKEN_BLOCK"},
    "attention/__init__.py": {"ATTENTION_TRITON_BLOCK_Q", "ATTENTION_TRITON_KEY_TILE"},
    "attention/cpu.py": {"CPU_ATTENTION_BLOCK_Q", "CPU_ATTENTION_KEY_TILE"},
    "reduce/api.py": {"REDUCE_LANES"},
    "models/decoder.py": {"GEMM_TILE_K", "ROW_PARALLEL_CHUNKS"},
    "custom_calls/gemm_ffi.py": {"GEMM_TILE_K"},
    "pallas/mosaic_loop.py": {"GEMM_TILE_K"},
    "pallas/gemm_triton.py": {"GEMM_TRITON_BLOCK_K"},
    "pallas/grouped_gemm_triton.py": {"GEMM_TRITON_BLOCK_K", "GROUPED_GEMM_BLOCK_M"},
    # The MoE product's row blocks (its K tile is mosaic_loop's).
    "pallas/gemm_mosaic.py": {"GROUPED_GEMM_BLOCK_M"},
    "grouped_gemm/cpu.py": {"CPU_COL_BLOCK", "GROUPED_GEMM_BLOCK_M"},
    "grouped_gemm/layout.py": {"GROUPED_GEMM_BLOCK_M"},
    "grouped_gemm/xla.py": {"GROUPED_GEMM_BLOCK_M"},
    "pallas/linear_logp_fwd.py": {"VOCAB_TILE", "LOGITS_BLOCK_H_TRITON",
                                  "LOGITS_BLOCK_H_INTERPRET"},
    "pallas/linear_logp_mosaic.py": {"GEMM_TILE_K", "VOCAB_TILE", "EPI_ROWS"},
    "pallas/attention_triton.py": {"ATTENTION_TRITON_BLOCK_Q", "ATTENTION_TRITON_KEY_TILE",
                                   "ATTENTION_TRITON_FWD_NUM_WARPS",
                                   "ATTENTION_TRITON_FWD_NUM_STAGES", "REDUCE_LANES"},
    "pallas/attention_mosaic.py": {"ATTENTION_MOSAIC_BLOCK_Q", "ATTENTION_MOSAIC_KEY_TILE"},
}
# Kernel files whose reduction order is fixed without a contract constant of their own: the
# tile comes from another kernel module (checked in test_kernels_use_the_contract_values), is
# an argument (the lane count of the reductions, passed by reduce/api.py), or is fixed by the
# shape alone (RMSNorm's halving tree over the row padded to a power of two; the softmax
# partials of a tile whose width is the caller's).
NO_CONSTANT_OF_THEIR_OWN = (
    "pallas/linear_logp_bwd.py", "pallas/lm_head_logits.py", "pallas/softmax_partials.py",
    "pallas/rmsnorm_triton.py", "pallas/reduce_triton.py", "reduce/fixed_order.py",
    "nn/norm.py", "pallas/attention_mosaic_bwd.py",
)
# Module-level integer constants of kernel files that name a block, tile, lane or chunk but
# are not contract constants, with why. Any other such literal fails
# test_no_kernel_defines_its_own_contract_constant: a reduction tile belongs in contract.py.
NOT_CONTRACT = {
    # Gradient tiles of the Mosaic attention backward: its dQ sums key blocks of
    # BWD_BLOCK_K, its dK/dV query blocks of BWD_BLOCK_Q. They fix the gradients' bits
    # (deterministic run to run, not claimed batch-invariant); the golden digests of the GPU
    # backward pin them.
    ("pallas/attention_mosaic_bwd.py", "BWD_BLOCK_K"),
    ("pallas/attention_mosaic_bwd.py", "BWD_BLOCK_Q"),
    # Layout and launch knobs that never change a bit (CUTLASS's M x N tiles: its K step
    # is kTileK, checked above).
    ("custom_calls/gemm_ffi.py", "TILES"),
    ("pallas/attention_mosaic.py", "LANES_MAX_D"),
    ("pallas/fixed_order.py", "UNROLL_TILES"),
    ("gemm/row_parallel.py", "CHUNK_TREE_MIN_ROWS"),
    ("gemm/row_parallel.py", "CHUNK_VIEW_STEP"),
}
# Files searched for literals: every kernel and every CPU implementation.
KERNEL_FILES = sorted({*USES, *NO_CONSTANT_OF_THEIR_OWN,
                       *(str(p.relative_to(_PACKAGE)) for p in (_PACKAGE / "pallas").glob("*.py")),
                       "_cpu.py", "gemm/cpu.py", "grouped_gemm/cpu.py", "linear_logp/cpu.py",
                       "attention/cpu.py",
                       "reduce/api.py", "reduce/fixed_order.py", "nn/norm.py",
                       "gemm/row_parallel.py", "attention/api.py"})


def _cuda_constant(name: str) -> int:
  text = (_CUDA_DIR / "det_gemm_sm90_kernels.cuh").read_text()
  found = re.findall(rf"constexpr\s+int\s+{name}\s*=\s*(\d+)\s*;", text)
  assert len(found) == 1, f"{name}: {found}"
  return int(found[0])


def _contract_names() -> set[str]:
  return {n for n in vars(contract) if n.isupper() and not n.startswith("_")}


def _names_used(rel: str) -> set[str]:
  """Contract constants a file takes: imported from ``jaxrl_kernels.contract`` (or from
  ``jaxrl_kernels._cpu``, which re-exports CPU_ROW_BLOCK), or read as ``contract.NAME``."""
  tree = ast.parse((_PACKAGE / rel).read_text())
  names = _contract_names()
  used = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module in ("jaxrl_kernels.contract",
                                                            "jaxrl_kernels._cpu"):
      used |= {a.name for a in node.names if a.name in names}
    elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id == "contract" and node.attr in names):
      used.add(node.attr)
  return used


def _module_int_literals(rel: str):
  """``(name, value)`` of module-level assignments of a number (or a dict of numbers)."""
  for node in ast.parse((_PACKAGE / rel).read_text()).body:
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
      continue
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    value = node.value
    numbers = [v for v in ast.walk(value) if isinstance(v, ast.Constant)
               and isinstance(v.value, int) and not isinstance(v.value, bool)]
    if not numbers or not isinstance(value, (ast.Constant, ast.Dict, ast.BinOp, ast.UnaryOp)):
      continue
    for t in targets:
      if isinstance(t, ast.Name):
        yield t.id, ast.unparse(value)


def test_cutlass_k_tile_is_the_contracts():
  """The CUDA GEMM's compile-time K tile equals the Mosaic GEMM's: the two give the
  same bits (tests/custom_calls: test_same_bits_as_mosaic)."""
  assert _cuda_constant("kTileK") == contract.GEMM_TILE_K
  # Every CUTLASS tile shape takes its K extent from kTileK, never a literal.
  text = (_CUDA_DIR / "det_gemm_sm90_kernels.cuh").read_text()
  shapes = re.findall(r"TileShape\s*=\s*Shape<([^;]*)>;", text)
  assert shapes and all(s.replace(" ", "").endswith("Int<kTileK>") for s in shapes), shapes


def test_kernels_use_the_contract_values():
  assert gemm_mosaic.TILE_K == mosaic_loop.TILE_K == gemm_ffi.TILE_K == contract.GEMM_TILE_K
  assert gemm_triton.CONTRACT_BLOCK_K == contract.GEMM_TRITON_BLOCK_K
  for dtype, block_k in contract.GEMM_TRITON_BLOCK_K.items():
    assert gemm_triton.default_config(dtype).block_k == block_k
  assert (attention_triton.BLOCK_Q, attention_triton.KEY_TILE) == (
      contract.ATTENTION_TRITON_BLOCK_Q, contract.ATTENTION_TRITON_KEY_TILE)
  assert (attention_triton.FWD_NUM_WARPS, attention_triton.FWD_NUM_STAGES) == (
      contract.ATTENTION_TRITON_FWD_NUM_WARPS, contract.ATTENTION_TRITON_FWD_NUM_STAGES)
  assert (attention_mosaic.BLOCK_Q, attention_mosaic.KEY_TILE) == (
      contract.ATTENTION_MOSAIC_BLOCK_Q, contract.ATTENTION_MOSAIC_KEY_TILE)
  assert (attention.BLOCK_Q, attention.KEY_TILE) == (
      contract.ATTENTION_TRITON_BLOCK_Q, contract.ATTENTION_TRITON_KEY_TILE)
  # The LM head: vocab tile, H step of the logits (Triton by dtype, interpret for every
  # dtype), the Mosaic epilogue rows; the backward and the sampler's logits kernel take
  # the forward's tile and H step.
  for mod in (linear_logp_fwd, linear_logp_bwd, lm_head_logits, linear_logp_mosaic):
    assert mod.VOCAB_TILE == contract.VOCAB_TILE, mod.__name__
  for dtype, step in contract.LOGITS_BLOCK_H_TRITON.items():
    assert linear_logp_fwd.block_h(jnp.dtype(dtype), interpret=False) == step
    assert linear_logp_fwd.block_h(jnp.dtype(dtype), interpret=True) == (
        contract.LOGITS_BLOCK_H_INTERPRET)
  for mod in (linear_logp_bwd, lm_head_logits):
    text = inspect.getsource(mod)
    assert "block_h=fwd.block_h(compute_dtype, interpret)" in text, mod.__name__
    assert "VOCAB_TILE = fwd.VOCAB_TILE" in text, mod.__name__
  assert (linear_logp_mosaic.TILE_K, linear_logp_mosaic.EPI_ROWS) == (
      contract.GEMM_TILE_K, contract.EPI_ROWS)
  # The three-GEMM objective: dW's token block, and a default token chunk made of them.
  assert three_gemm.DW_TOKEN_BLOCK == contract.OBJECTIVE_DW_TOKEN_BLOCK
  assert three_gemm.DEFAULT_TOKEN_CHUNK % contract.OBJECTIVE_DW_TOKEN_BLOCK == 0
  # The "cpu" implementation: row and column blocks, vocab chunk, attention tiles.
  assert _cpu.CPU_ROW_BLOCK == contract.CPU_ROW_BLOCK
  assert (gemm_cpu.CPU_ROW_BLOCK, gemm_cpu.CPU_COL_BLOCK) == (
      contract.CPU_ROW_BLOCK, contract.CPU_COL_BLOCK)
  assert (linear_logp_cpu.CPU_ROW_BLOCK, linear_logp_cpu.CPU_VOCAB_CHUNK,
          linear_logp_cpu.VOCAB_TILE) == (
      contract.CPU_ROW_BLOCK, contract.CPU_VOCAB_CHUNK, contract.VOCAB_TILE)
  assert (attention_cpu.BLOCK_Q, attention_cpu.KEY_TILE) == (
      contract.CPU_ATTENTION_BLOCK_Q, contract.CPU_ATTENTION_KEY_TILE)
  # The fixed-order reductions: the lane count the API passes to both implementations.
  assert reduce_api.REDUCE_LANES == contract.REDUCE_LANES
  assert "lanes=REDUCE_LANES" in inspect.getsource(reduce_api._reduce2d)
  assert "lanes=REDUCE_LANES" in inspect.getsource(reduce_api._kernel_rows)
  assert "lanes=REDUCE_LANES" in inspect.getsource(reduce_api._cumulative)


def test_each_kernel_file_takes_its_constants_from_the_contract():
  """Every kernel file imports (or reads as ``contract.X``) the constants that fix its
  bits: the table USES is the map of which constant governs which file."""
  for rel, want in USES.items():
    assert _names_used(rel) == want, f"{rel}: uses {sorted(_names_used(rel))}, want {sorted(want)}"
  for rel in NO_CONSTANT_OF_THEIR_OWN:
    assert not _names_used(rel), f"{rel}: {sorted(_names_used(rel))}"
  # No contract constant is dead: each governs at least one file.
  used = set().union(*USES.values())
  assert used == _contract_names(), sorted(_contract_names() - used)


def test_today_s_values():
  """The values the recorded GPU results and the golden digests were produced with;
  changing one changes bits (update TODAY, the golden digests and the recorded results
  together, deliberately)."""
  names = _contract_names()
  assert names == set(TODAY), (f"not pinned: {sorted(names - set(TODAY))}; "
                               f"pinned but gone: {sorted(set(TODAY) - names)}")
  for name, value in TODAY.items():
    assert getattr(contract, name) == value, f"contract.{name} = {getattr(contract, name)!r}"


def test_contract_constants_are_consistent():
  """Relations the kernels rely on: the CPU vocab chunk holds whole vocab tiles, the lane
  counts, key tiles and chunk counts are powers of two, the CPU row block holds whole CPU
  attention query blocks."""
  pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
  assert contract.CPU_VOCAB_CHUNK % contract.VOCAB_TILE == 0
  for name in ("REDUCE_LANES", "CPU_ATTENTION_KEY_TILE", "ROW_PARALLEL_CHUNKS", "VOCAB_TILE"):
    assert pow2(getattr(contract, name)), name


def test_row_parallel_default_is_the_contracts():
  """row_parallel_matmul's default chunk count is the contract's, a power of two (its
  adjacent-pair tree needs one), and the largest TP degree of the canonical order."""
  default = inspect.signature(row_parallel_matmul).parameters["chunks"].default
  assert default == contract.ROW_PARALLEL_CHUNKS
  assert default & (default - 1) == 0


def test_no_kernel_defines_its_own_contract_constant():
  """Kernel files take these names from contract.py, never a literal of their own: no
  module-level number bound to a contract name (or the local names kernels give them),
  and every module-level number named like a tile, block, lane or chunk is either a
  contract constant or listed in NOT_CONTRACT with why."""
  local = {"TILE_K", "BLOCK_Q", "KEY_TILE", "FWD_NUM_WARPS", "FWD_NUM_STAGES", "VOCAB_TILE",
           "EPI_ROWS", "LANES", "BLOCK_K", "CONTRACT_BLOCK_K", "BLOCK_H"}
  tile_like = re.compile(r"BLOCK|TILE|LANE|CHUNK|STEP")
  for rel in KERNEL_FILES:
    for name, value in _module_int_literals(rel):
      assert name not in _contract_names() | local, f"{rel}: {name} = {value}"
      if tile_like.search(name):
        assert (rel, name) in NOT_CONTRACT, (
            f"{rel}: {name} = {value} looks like a reduction tile; move it to contract.py "
            f"(or list it in NOT_CONTRACT with why it fixes no bit)")
  for rel, name in NOT_CONTRACT:  # the list stays true
    assert name in dict(_module_int_literals(rel)), f"{rel}: {name} is gone"


# The backward's reduction steps: not part of the cross-layout contract (gradients are
# deterministic run to run; docs/CONTRACT.md), but they fix the gradients' bits, which the
# golden digests record. Pinned here so that a change is seen on the CPU too, not only by
# the GPU digests: the attention dQ key step, dK/dV query step and range split (Triton, by
# dtype and head dim; Mosaic), and the LM head backward's vocab chunk, dH vocab step and
# dW token step (by compute dtype; interpret mode).
GRADIENT_STEPS = {
    ("attention_triton", "bfloat16", 64): (64, 64, 2048),
    ("attention_triton", "bfloat16", 128): (32, 64, 4096),
    ("attention_triton", "float32", 64): (32, 64, 2048),
    ("attention_triton", "float32", 128): (32, 64, 2048),
    ("attention_mosaic_bwd",): (64, 64),
    ("linear_logp_bwd", "bfloat16", False): (4096, 64, 64),
    ("linear_logp_bwd", "float32", False): (4096, 32, 32),
    ("linear_logp_bwd", "bfloat16", True): (512, 128, 32),
    ("linear_logp_bwd", "float32", True): (512, 128, 32),
}


def _gradient_steps(key):
  if key[0] == "attention_triton":
    c = attention_triton.default_backward_config(jnp.dtype(key[1]), key[2])
    return (c.dq_block_k, c.dkv_block_q, c.dkv_split_rows)
  if key[0] == "attention_mosaic_bwd":
    return (attention_mosaic_bwd.BWD_BLOCK_K, attention_mosaic_bwd.BWD_BLOCK_Q)
  c = linear_logp_bwd.default_config(jnp.dtype(key[1]), interpret=key[2])
  return (c.chunk, c.dh_block_v, c.dw_block_t)


def test_gradient_steps_are_pinned():
  """The backward kernels' reduction steps are today's (GRADIENT_STEPS says which): changing
  one changes gradient bits, so the golden digests and this table change together."""
  got = {key: _gradient_steps(key) for key in GRADIENT_STEPS}
  assert got == GRADIENT_STEPS
