"""Every constant that fixes the bits of a result, named and documented once.

A constant here decides which terms are reduced together and in which order
(a K tile, a vocab tile, a key tile, the rows of one wgmma-layout reduction).
Changing one changes the bits of every result that depends on it, so kernels
import these names instead of defining their own, and
``tests/test_contract.py`` checks the CUDA sources against them. Free tuning
knobs (M/N tiles, warpgroups, pipeline depth, grid walk) are not here: they
live in each kernel's config dataclass and never change a row's bits.
"""

from __future__ import annotations

# --- gemm
# K tile of the Mosaic GPU and CUTLASS (``kTileK`` in
# custom_calls/det_gemm_sm90_kernels.cuh) GEMMs: every output element sums its
# products in 64-element K steps in ascending order (128 bytes of bf16/fp16,
# one 128B swizzle row). The Mosaic LM-head forward walks H in the same steps.
GEMM_TILE_K = 64
# K tile of the Triton and interpret GEMM by input dtype: the same ascending
# walk, 32 elements for float32 (3xTF32 dots) and 64 for 16-bit inputs.
GEMM_TRITON_BLOCK_K = {"bfloat16": 64, "float16": 64, "float32": 32}

# --- grouped_gemm (mixture-of-experts)
# Rows per tile of the tile-aligned group layout (grouped_gemm/layout.py): each
# expert's rows start on a multiple of it, so every tile holds one expert's rows
# and every product is a [GROUPED_GEMM_BLOCK_M, K] x [K, N-block] dot walking K in
# the GEMM's K tile (GEMM_TRITON_BLOCK_K; CPU_COL_BLOCK columns on the CPU), whatever
# the number of rows the expert got.
GROUPED_GEMM_BLOCK_M = 64

# --- linear_logp
# Vocab columns per softmax partial (m, s, u): partials are merged in ascending
# tile order, and tensor-parallel shard boundaries must fall on multiples of it.
VOCAB_TILE = 128
# H step of the float32 logit accumulation of the Triton logits tile, by
# compute dtype (interpret mode uses LOGITS_BLOCK_H_INTERPRET for every dtype).
LOGITS_BLOCK_H_TRITON = {"bfloat16": 64, "float16": 64, "float32": 32}
LOGITS_BLOCK_H_INTERPRET = 64
# Rows per row reduction of the Mosaic LM-head epilogue: Mosaic splits a row
# reduction's partial accumulators by the array's rows per thread, so this
# height fixes the reduction tree of every row's partials.
EPI_ROWS = 64
# Token rows per dW product of the three-GEMM fused objective (linear_logp/three_gemm.py):
# dW = ((0 + P_0) + P_1) + ..., P_b = h_b^T dz_b the float32 product of token rows
# [b B, (b + 1) B) from zero, b ascending. The token chunk (a free knob) is a multiple of
# it, so dW's bits do not depend on the chunk.
OBJECTIVE_DW_TOKEN_BLOCK = 256

# --- tensor parallel
# K chunks of a row-parallel GEMM (o_proj, down_proj; gemm/row_parallel.py): K is cut
# into this many equal contiguous chunks, each reduced by det_matmul in float32 from zero,
# and the chunk partials are summed by the fixed adjacent-pair tree
# ((P0+P1)+(P2+P3))+((P4+P5)+(P6+P7)). A TP degree p (a divisor of it) owns C/p adjacent
# chunks, i.e. one complete subtree, so TP = 1, 2, 4, 8 and the unsharded layer give the
# same bits. A power of two; the largest TP degree the canonical order allows. A DecoderLM
# layer runs at most this many (models.canonical_row_chunks: whole K tiles where the
# model's TP degrees allow fewer).
ROW_PARALLEL_CHUNKS = 8

# --- attention
# Triton (and interpret) forward: queries per program (decode pads its query to
# it), keys per tile walked in ascending order from key 0, and the compiler
# parameters under which that instruction sequence was shown to keep the bits.
ATTENTION_TRITON_BLOCK_Q = 64
ATTENTION_TRITON_KEY_TILE = 64
ATTENTION_TRITON_FWD_NUM_WARPS = 4
ATTENTION_TRITON_FWD_NUM_STAGES = 2
# Mosaic GPU forward: query rows per compute warpgroup (the wgmma M) and keys
# per tile walked in ascending order from key 0 (its own bits, not Triton's).
ATTENTION_MOSAIC_BLOCK_Q = 64
ATTENTION_MOSAIC_KEY_TILE = 128

# --- cpu
# The "cpu" implementation (gemm/cpu.py, linear_logp/cpu.py) runs every product
# whose rows must be invariant as XLA dots of one fixed shape per weight: token
# rows in zero-padded blocks of CPU_ROW_BLOCK, so XLA's CPU GEMM (whose blocking
# and so whose bits depend on the operand shapes) never sees another M. Sums
# over tokens (dW, db, det_matmul's dB) add fixed-shape products of
# CPU_ROW_BLOCK token rows in ascending order: deterministic run to run.
CPU_ROW_BLOCK = 128
# Output columns per product of the "cpu" det_matmul ([CPU_ROW_BLOCK, K] x [K,
# CPU_COL_BLOCK], the last block zero-padded): XLA's CPU GEMM also picks its K
# blocking from N, so without a fixed column block a column-parallel shard (N / tp
# columns) would reduce K in another order than the unsharded layer.
CPU_COL_BLOCK = 128
# Vocab columns per logits product of the CPU LM head ([CPU_ROW_BLOCK, H] x
# [H, CPU_VOCAB_CHUNK]; a multiple of VOCAB_TILE). The last chunk is zero-padded
# to it, so every logit of a head comes out of the same dot shape.
CPU_VOCAB_CHUNK = 1024
# The CPU causal attention (attention/cpu.py): query rows of one (batch entry, kv
# head) in blocks of CPU_ATTENTION_BLOCK_Q (a decode step pads its rows to one
# block), keys walked in tiles of CPU_ATTENTION_KEY_TILE (a power of two) from key
# 0 in ascending order. Every score and P @ V product is a dot of one shape.
CPU_ATTENTION_BLOCK_Q = 32
CPU_ATTENTION_KEY_TILE = 128

# --- reduce
# Lanes of the fixed-order reductions (reduce/, used by ``batch_invariant``): lane j
# adds x[j], x[j + L], x[j + 2L], ... in ascending order, then the lanes fold in
# halves; the cumulative ops walk tiles of this size. Every element's place in a
# sum depends on its index alone, so trailing exact zeros never change the bits.
REDUCE_LANES = 128
