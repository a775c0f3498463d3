// The CUTLASS 3.x SM90 kernels of the deterministic GEMM (included by the
// det_gemm_sm90_tile_<name>.cu translation units only).
//
//   out[m, n] = sum_k op(lhs)[m, k] * op(rhs)[k, n]      (fp32 accumulation)
//
// TMA loads into swizzled shared memory, wgmma (m64nNk16) with fp32
// accumulators in registers, a warp-specialized producer/consumer pipeline
// and the plain persistent data-parallel tile scheduler. Every output tile
// walks K in kTileK steps in ascending order; no split-K, no stream-K. TMA
// zero-fills loads past the edge of M, N or K and clips stores, so no operand
// is padded or copied.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "det_gemm_sm90.h"

namespace jaxrl_kernels {
namespace det_gemm {

using namespace cute;  // NOLINT: CuTe's shape literals (_128, _64, ...).

// ---------------------------------------------------------------------------
// Part of the numerical contract: the K tile (64 elements = 128 bytes of
// bf16/fp16, one 128B swizzle row, consumed as 4 ascending k16 wgmma steps) and
// the fp32 accumulator. Never derived from the problem shape.
constexpr int kTileK = 64;
// Free knobs (do not touch a row's K order): the M/N tile, the cluster and the
// schedule. Every output element is the same chain of m64nNk16 wgmma steps over
// ascending K tiles in each configuration, so they give the same bits
// (tests/custom_calls: test_every_tile_gives_the_same_bits) and the choice may
// depend on the shape, M included (gemm_ffi.py: tile_for).

// Large: 128x256 per CTA, two consumer warpgroups cooperating on one tile (64
// rows each), 2x1 cluster (TMA multicast of the B tile).
struct LargeTile {
  using TileShape = Shape<_128, _256, Int<kTileK>>;
  using ClusterShape = Shape<_2, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};

// Medium: 128x128 per consumer warpgroup, two warpgroups ping-ponging on their
// own tiles, 2x1 cluster: twice the tiles of LargeTile, for shapes whose large
// tiles fill the last wave of CTAs poorly (M=1024, N=14336 on 132 SMs: 448
// large tiles are 3.4 waves, 896 medium tiles 6.8). H100, that shape: 761
// TFLOP/s against 740 for the same tile cooperative (one tile per two
// warpgroups) and 702 for LargeTile (benchmarks/results/gemm_h100.md).
struct MediumTile {
  using TileShape = Shape<_128, _128, Int<kTileK>>;
  using ClusterShape = Shape<_2, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
};

// Small: 64x128 per consumer warpgroup, two warpgroups ping-ponging on their
// own tiles (one's epilogue overlaps the other's mainloop): 4x the tiles of
// LargeTile, for shapes whose large tiles leave SMs idle (small M).
struct SmallTile {
  using TileShape = Shape<_64, _128, Int<kTileK>>;
  using ClusterShape = Shape<_1, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
};

// Tried and dropped (H100 sweeps, benchmarks/results/gemm_h100.md):
// 256x128 cooperative (2x1 cluster) and 128x256 cooperative with a 1x2 cluster
// were never faster than LargeTile on any benchmark shape.

template <int kTile>
struct TileOf;
template <>
struct TileOf<kLarge> {
  using type = LargeTile;
};
template <>
struct TileOf<kMedium> {
  using type = MediumTile;
};
template <>
struct TileOf<kSmall> {
  using type = SmallTile;
};
// ---------------------------------------------------------------------------

template <int kDtype>
struct ElementOf;
template <>
struct ElementOf<kBF16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct ElementOf<kF16> {
  using type = cutlass::half_t;
};
template <>
struct ElementOf<kF32> {
  using type = float;
};

// TMA needs 16-byte aligned base pointers and strides.
constexpr int kAlignBytes = 16;

template <class Element>
constexpr int AlignmentOf() {
  return kAlignBytes * 8 / cutlass::sizeof_bits<Element>::value;
}

// One kernel: input element type, output element type and operand layouts.
// CUTLASS's B operand is N x K: RowMajor B is our [K, N] rhs, ColumnMajor B is
// our [N, K] rhs (rhs_transposed). ColumnMajor A is our [K, M] lhs.
template <class ElementIn, class ElementOut, class LayoutA, class LayoutB, class Tile>
struct DetGemm {
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = typename Tile::TileShape;
  using ClusterShape = typename Tile::ClusterShape;
  using MainloopSchedule = typename Tile::MainloopSchedule;
  using EpilogueSchedule = typename Tile::EpilogueSchedule;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      // No C operand (void): D = 1 * acc, then one round-to-nearest-even conversion.
      void, LayoutD, AlignmentOf<ElementOut>(), ElementOut, LayoutD, AlignmentOf<ElementOut>(),
      EpilogueSchedule>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA,
      AlignmentOf<ElementIn>(), ElementIn, LayoutB, AlignmentOf<ElementIn>(), float, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  // The default scheduler of the cooperative and ping-pong kernels is the
  // persistent data-parallel one (PersistentTileSchedulerSm90): one CTA (or
  // warpgroup) computes a whole output tile over the whole K range. Stream-K
  // is never selected.
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                      CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

inline int CachedSmCount(int device) {
  // XLA calls the handler on a thread whose current device is the stream's.
  static std::atomic<int> cache[64] = {};
  if (device < 0 || device >= 64) {
    return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }
  int count = cache[device].load(std::memory_order_relaxed);
  if (count == 0) {
    count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
    cache[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

inline Status CudaError(const char* what, cudaError_t err) {
  return {std::string("jaxrl_det_gemm_sm90: ") + what + " failed: " + cudaGetErrorName(err) +
          " (" + cudaGetErrorString(err) + ")"};
}

inline Status CutlassError(const char* what, cutlass::Status status) {
  return {std::string("jaxrl_det_gemm_sm90: CUTLASS ") + what + " failed: " +
          cutlassGetStatusString(status)};
}

struct WalkOrder {
  int swizzle;
  cutlass::gemm::kernel::detail::RasterOrderOptions raster;
};

// The persistent scheduler's walk over output tiles: groups of `swizzle` tile
// rows (or columns) walked together so that concurrently running CTAs share
// operand tiles in L2, along M or N. The caller's WalkKnobs (the FFI
// attributes; benchmarks/tune_gemm_cuda.py sweeps them) override the default.
//
// Default (measured on an H100, benchmarks/results/gemm_h100.md): swizzle 8
// from 32 rows of 128 (M >= 4096: M=8192, K=4096, N=14336 went from 689 to
// 786 TFLOP/s), 2 from 8 rows of 128, else 1; CUTLASS's raster heuristic. At 8
// rows of 128 swizzle 8 halved the speed. (Counted in 128-row units whatever
// the tile, as tuned.)
inline WalkOrder SchedulerKnobs(int64_t m, WalkKnobs knobs) {
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  const int64_t rows128 = (m + 127) / 128;
  WalkOrder w{rows128 >= 32 ? 8 : (rows128 >= 8 ? 2 : 1), Raster::Heuristic};
  if (knobs.swizzle == 1 || knobs.swizzle == 2 || knobs.swizzle == 4 || knobs.swizzle == 8) {
    w.swizzle = knobs.swizzle;
  }
  if (knobs.raster == kRasterAlongM) w.raster = Raster::AlongM;
  if (knobs.raster == kRasterAlongN) w.raster = Raster::AlongN;
  return w;
}

template <class Config>
Status RunGemm(cudaStream_t stream, WalkKnobs knobs, int m, int n, int k, const void* lhs,
               const void* rhs, void* out) {
  using Gemm = typename Config::Gemm;
  using ElementA = typename Gemm::ElementA;
  using ElementB = typename Gemm::ElementB;
  using ElementD = typename Gemm::ElementD;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideC = typename Gemm::GemmKernel::StrideC;
  using StrideD = typename Gemm::GemmKernel::StrideD;

  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    return CudaError("cudaGetDevice", err);
  }
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = CachedSmCount(device);

  // Packed strides of the layouts chosen in Config: e.g. a ColumnMajor A
  // (our [K, M] lhs) gets stride (1, M), a RowMajor A stride (K, 1).
  StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, {m, k, 1});
  StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, {n, k, 1});
  StrideC stride_c = cutlass::make_cute_packed_stride(StrideC{}, {m, n, 1});
  StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, {m, n, 1});

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const ElementA*>(lhs), stride_a, static_cast<const ElementB*>(rhs), stride_b},
      {{1.0f, 0.0f}, nullptr, stride_c, static_cast<ElementD*>(out), stride_d},
      hw_info};
  // The CTA walk order is a free knob: it changes which tile a CTA takes,
  // never a tile's K order (so never a bit). See SchedulerKnobs.
  {
    const WalkOrder walk = SchedulerKnobs(m, knobs);
    args.scheduler.max_swizzle_size = walk.swizzle;
    args.scheduler.raster_order = walk.raster;
  }

  Gemm gemm;
  if (cutlass::Status s = gemm.can_implement(args); s != cutlass::Status::kSuccess) {
    return {std::string("jaxrl_det_gemm_sm90: CUTLASS cannot run M=") + std::to_string(m) +
                " N=" + std::to_string(n) + " K=" + std::to_string(k) + " (" +
                cutlassGetStatusString(s) +
                "); the contiguous dimension of every operand must be a multiple of 16 bytes",
            true};
  }
  // No workspace: we cannot allocate inside a CUDA-graph capture, and the
  // data-parallel scheduler needs none.
  if (size_t ws = Gemm::get_workspace_size(args); ws != 0) {
    return {"jaxrl_det_gemm_sm90: kernel unexpectedly asks for " + std::to_string(ws) +
            " bytes of workspace"};
  }
  if (cutlass::Status s = gemm.initialize(args, nullptr, stream); s != cutlass::Status::kSuccess) {
    return CutlassError("initialize", s);
  }
  if (cutlass::Status s = gemm.run(stream); s != cutlass::Status::kSuccess) {
    return CutlassError("run", s);
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return CudaError("kernel launch", err);
  }
  return {};
}

template <int kTile, int kIn, int kOut, bool kLhsT, bool kRhsT>
Status RunTile(cudaStream_t stream, WalkKnobs walk, int m, int n, int k, const void* lhs,
               const void* rhs, void* out) {
  using LayoutA = std::conditional_t<kLhsT, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<kRhsT, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using Config = DetGemm<typename ElementOf<kIn>::type, typename ElementOf<kOut>::type, LayoutA,
                         LayoutB, typename TileOf<kTile>::type>;
  return RunGemm<Config>(stream, walk, m, n, k, lhs, rhs, out);
}

}  // namespace det_gemm
}  // namespace jaxrl_kernels
