"""``jaxrl_kernels/contract.py`` is the one source of every bit-fixing constant: the
kernels use its values, and the CUDA source's K tile is checked against it."""

import inspect
import pathlib
import re

from jaxrl_kernels import attention, contract, row_parallel_matmul
from jaxrl_kernels.custom_calls import gemm_ffi
from jaxrl_kernels.pallas import attention_mosaic, attention_triton, gemm_mosaic, gemm_triton

_CUDA_DIR = pathlib.Path(gemm_ffi.__file__).parent


def _cuda_constant(name: str) -> int:
  text = (_CUDA_DIR / "det_gemm_sm90_kernels.cuh").read_text()
  found = re.findall(rf"constexpr\s+int\s+{name}\s*=\s*(\d+)\s*;", text)
  assert len(found) == 1, f"{name}: {found}"
  return int(found[0])


def test_cutlass_k_tile_is_the_contracts():
  """The CUDA GEMM's compile-time K tile equals the Mosaic GEMM's: the two give the
  same bits (tests/custom_calls: test_same_bits_as_mosaic)."""
  assert _cuda_constant("kTileK") == contract.GEMM_TILE_K
  # Every CUTLASS tile shape takes its K extent from kTileK, never a literal.
  text = (_CUDA_DIR / "det_gemm_sm90_kernels.cuh").read_text()
  shapes = re.findall(r"TileShape\s*=\s*Shape<([^;]*)>;", text)
  assert shapes and all(s.replace(" ", "").endswith("Int<kTileK>") for s in shapes), shapes


def test_kernels_use_the_contract_values():
  assert gemm_mosaic.TILE_K == gemm_ffi.TILE_K == contract.GEMM_TILE_K
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


def test_today_s_values():
  """The values the recorded GPU results were measured with; changing one changes bits."""
  assert contract.GEMM_TILE_K == 64
  assert contract.GEMM_TRITON_BLOCK_K == {"bfloat16": 64, "float16": 64, "float32": 32}
  assert contract.VOCAB_TILE == 128
  assert contract.EPI_ROWS == 64
  assert (contract.ATTENTION_TRITON_BLOCK_Q, contract.ATTENTION_TRITON_KEY_TILE) == (64, 64)
  assert (contract.ATTENTION_TRITON_FWD_NUM_WARPS,
          contract.ATTENTION_TRITON_FWD_NUM_STAGES) == (4, 2)
  assert (contract.ATTENTION_MOSAIC_BLOCK_Q, contract.ATTENTION_MOSAIC_KEY_TILE) == (64, 128)
  assert contract.ROW_PARALLEL_CHUNKS == 8
  assert contract.LOGITS_BLOCK_H_TRITON == {"bfloat16": 64, "float16": 64, "float32": 32}
  assert contract.LOGITS_BLOCK_H_INTERPRET == 64
  assert contract.REDUCE_LANES == 128
  # The "cpu" implementation's blocks. Not every change of one shows in the golden digests
  # (tests/test_golden.py): XLA's CPU GEMM may give a row the same bits at another block
  # height on one machine and not on another, so the values are pinned here.
  assert (contract.CPU_ROW_BLOCK, contract.CPU_COL_BLOCK, contract.CPU_VOCAB_CHUNK) == (
      128, 128, 1024)
  assert (contract.CPU_ATTENTION_BLOCK_Q, contract.CPU_ATTENTION_KEY_TILE) == (32, 128)


def test_every_contract_constant_is_pinned():
  """A constant added to contract.py without its value in test_today_s_values fails here."""
  names = {n for n in vars(contract) if n.isupper() and not n.startswith("_")}
  source = inspect.getsource(test_today_s_values)
  assert sorted(n for n in names if f"contract.{n}" not in source) == []


def test_row_parallel_default_is_the_contracts():
  """row_parallel_matmul's default chunk count is the contract's, a power of two (its
  adjacent-pair tree needs one), and the largest TP degree of the canonical order."""
  default = inspect.signature(row_parallel_matmul).parameters["chunks"].default
  assert default == contract.ROW_PARALLEL_CHUNKS
  assert default & (default - 1) == 0


def test_no_kernel_defines_its_own_contract_constant():
  """Kernel files take these names from contract.py, never a literal of their own."""
  pallas = pathlib.Path(gemm_mosaic.__file__).parent
  for path in (*pallas.glob("gemm_*.py"), *pallas.glob("attention_*.py")):
    text = path.read_text()
    for name in ("TILE_K", "BLOCK_Q", "KEY_TILE", "FWD_NUM_WARPS", "FWD_NUM_STAGES"):
      assert not re.search(rf"^{name}\s*=\s*\d", text, re.M), f"{path.name}: {name}"
