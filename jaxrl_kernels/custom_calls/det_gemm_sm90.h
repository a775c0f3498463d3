// The kernels of the deterministic SM90 GEMM, as seen by the FFI handler.
//
// Each CUTLASS tile configuration is compiled in its own translation unit
// (det_gemm_sm90_tile_<name>.cu, all sharing det_gemm_sm90_kernels.cuh), so
// nvcc builds them in parallel; the FFI handler (det_gemm_sm90.cu) includes no
// CUTLASS header and calls them through RunTile.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace jaxrl_kernels {
namespace det_gemm {

// The tile configurations (det_gemm_sm90_kernels.cuh). Free knobs: every one
// computes each output element as the same chain of m64nNk16 wgmma steps over
// ascending 64-wide K tiles with one fp32 accumulator, so they give the same
// bits. The numbering is the FFI attribute `tile` (gemm_ffi.py: TILES).
enum TileId : int { kLarge = 0, kMedium = 1, kSmall = 2 };
constexpr int kNumTiles = 3;
// Element types: the input type and the output type of the kernel.
enum DtypeId : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

// The persistent scheduler's walk over output tiles (free knobs, the FFI
// attributes `swizzle` and `raster`): `swizzle` tile rows (or columns) walked
// together, 0 for the default by M; `raster` 0 = CUTLASS's heuristic, 1 = along
// M, 2 = along N. They move tiles between CTAs, never a tile's K order.
struct WalkKnobs {
  int swizzle = 0;
  int raster = 0;
};
enum RasterId : int { kRasterHeuristic = 0, kRasterAlongM = 1, kRasterAlongN = 2 };

// A launch result: empty on success, else the message of the failure;
// `invalid_argument` tells a caller error (CUTLASS cannot run the shape) from
// an internal one.
struct Status {
  std::string error;
  bool invalid_argument = false;
  bool ok() const { return error.empty(); }
};

// Enqueues out = op(lhs) @ op(rhs) on `stream` with tile configuration kTile
// and CTA walk `walk`.
// Instantiated (explicitly) in det_gemm_sm90_tile_<name>.cu for the input /
// output types and layouts the handler dispatches to.
template <int kTile, int kIn, int kOut, bool kLhsT, bool kRhsT>
Status RunTile(cudaStream_t stream, WalkKnobs walk, int m, int n, int k, const void* lhs,
               const void* rhs, void* out);

}  // namespace det_gemm
}  // namespace jaxrl_kernels

// The explicit instantiations of one tile, written in its translation unit
// inside namespace jaxrl_kernels::det_gemm as `JAXRL_DET_GEMM_INSTANTIATE(kLarge)`
// (the handler sees only the declaration): NN and NT with output = input or float32, TN with output = input
// (dB = A^T dC); TT has no caller.
#define JAXRL_DET_GEMM_FOR_EACH_KERNEL(X, TILE)                                     \
  X(TILE, kBF16, kBF16, false, false) X(TILE, kBF16, kF32, false, false)            \
  X(TILE, kF16, kF16, false, false) X(TILE, kF16, kF32, false, false)               \
  X(TILE, kBF16, kBF16, false, true) X(TILE, kBF16, kF32, false, true)              \
  X(TILE, kF16, kF16, false, true) X(TILE, kF16, kF32, false, true)                 \
  X(TILE, kBF16, kBF16, true, false) X(TILE, kF16, kF16, true, false)

#define JAXRL_DET_GEMM_INSTANTIATE_ONE(TILE, IN, OUT, LT, RT) \
  template Status RunTile<TILE, IN, OUT, LT, RT>(cudaStream_t, WalkKnobs, int, int, int, \
                                                 const void*, const void*, void*);

#define JAXRL_DET_GEMM_INSTANTIATE(TILE) \
  JAXRL_DET_GEMM_FOR_EACH_KERNEL(JAXRL_DET_GEMM_INSTANTIATE_ONE, TILE)

