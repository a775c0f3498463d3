// Deterministic, batch-invariant GEMM for Hopper (sm_90a) as an XLA FFI custom call.
//
//   out[m, n] = sum_k op(lhs)[m, k] * op(rhs)[k, n]      (fp32 accumulation)
//
//   lhs: [M, K] row-major, or [K, M] when lhs_transposed (read M-major in place)
//   rhs: [K, N] row-major, or [N, K] when rhs_transposed (read K-major in place)
//   out: [M, N] row-major, bf16 / fp16 / fp32
//
// Built on CUTLASS 3.x SM90 collectives: TMA loads into swizzled shared memory,
// wgmma (m64nNk16) with fp32 accumulators in registers, a warp-specialized
// producer/consumer pipeline (KernelTmaWarpSpecializedCooperative) and the plain
// persistent data-parallel tile scheduler. Every output tile walks K in kTileK
// steps in ascending order; no split-K, no stream-K. TMA zero-fills loads past
// the edge of M, N or K and clips stores, so no operand is padded or copied.
//
// Numerical contract (see docs/cuda_ffi.md): the tile shape and K order are
// compile-time constants, identical for every M, N and K, so a row's bits never
// depend on the batch it rides in.

// jaxlib >= 0.11's FFI headers leave XLA_FFI_Handler_Bundle::record
// uninitialised; some host toolchains (the GPU image's) make that warning an
// error whatever the command line says, so silence it for this file.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
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
#include "xla/ffi/api/ffi.h"

namespace jaxrl_kernels {
namespace {

namespace ffi = xla::ffi;
using namespace cute;  // NOLINT: CuTe's shape literals (_128, _64, ...).

// ---------------------------------------------------------------------------
// Part of the numerical contract: the K tile (64 elements = 128 bytes of
// bf16/fp16, one 128B swizzle row, consumed as 4 ascending k16 wgmma steps) and
// the fp32 accumulator. Never derived from the problem shape.
constexpr int kTileK = 64;
// Free knobs (do not touch a row's K order): the M/N tile, the cluster and
// the schedule. Two configurations; every output element is the same chain of
// m64nNk16 wgmma steps over ascending K tiles in both, so they give the same
// bits (tests/custom_calls: test_every_tile_gives_the_same_bits) and the
// choice may depend on the shape, M included (TileFor).
constexpr int kTileM = 128;  // the large tile's rows (the walk rule counts them)

// Large: 128x256 per CTA, two consumer warpgroups cooperating on one tile,
// 2x1 cluster (TMA multicast of the B tile).
struct LargeTile {
  using TileShape = Shape<Int<kTileM>, _256, Int<kTileK>>;
  using ClusterShape = Shape<_2, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};

// Small: 64x128 per consumer warpgroup, two warpgroups ping-ponging on their
// own tiles: 4x the tiles of LargeTile, for shapes whose large tiles leave
// SMs idle (small M, or a last wave mostly empty).
struct SmallTile {
  using TileShape = Shape<_64, _128, Int<kTileK>>;
  using ClusterShape = Shape<_1, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
};
// ---------------------------------------------------------------------------

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

  // The default scheduler of the cooperative kernel is the persistent
  // data-parallel one (PersistentTileSchedulerSm90): one CTA computes a whole
  // output tile over the whole K range. Stream-K is never selected.
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                      CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

int CachedSmCount(int device) {
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

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jaxrl_det_gemm_sm90: ") + what + " failed: " +
                        cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

ffi::Error CutlassError(const char* what, cutlass::Status status) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxrl_det_gemm_sm90: CUTLASS ") +
                                                   what + " failed: " +
                                                   cutlassGetStatusString(status));
}

struct WalkOrder {
  int swizzle;
  cutlass::gemm::kernel::detail::RasterOrderOptions raster;
};

// The persistent scheduler's walk over output tiles: groups of `swizzle` tile
// rows (or columns) walked together so that concurrently running CTAs share
// operand tiles in L2, along M or N. JAXRL_DET_GEMM_SWIZZLE (1, 2, 4, 8) and
// JAXRL_DET_GEMM_RASTER (h = CUTLASS's heuristic, m, n) override the default,
// for tuning (benchmarks/tune_gemm_cuda.py); read at every call.
//
// Default (measured on an H100, benchmarks/results/gemm_h100.md, session 3):
// swizzle 8 from 32 tile rows (M >= 4096: M=8192, K=4096, N=14336 went from
// 689 to 786 TFLOP/s), 2 from 8 tile rows, else 1; CUTLASS's raster heuristic.
// At 8 tile rows swizzle 8 halved the speed.
WalkOrder SchedulerKnobs(int64_t m, int64_t n) {
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  const int64_t tile_rows = (m + kTileM - 1) / kTileM;
  WalkOrder w{tile_rows >= 32 ? 8 : (tile_rows >= 8 ? 2 : 1), Raster::Heuristic};
  if (const char* s = std::getenv("JAXRL_DET_GEMM_SWIZZLE"); s != nullptr && *s != '\0') {
    const int v = std::atoi(s);
    if (v == 1 || v == 2 || v == 4 || v == 8) w.swizzle = v;
  }
  if (const char* r = std::getenv("JAXRL_DET_GEMM_RASTER"); r != nullptr) {
    if (r[0] == 'm') w.raster = Raster::AlongM;
    if (r[0] == 'n') w.raster = Raster::AlongN;
  }
  (void)n;
  return w;
}

template <class Config>
ffi::Error RunGemm(cudaStream_t stream, int m, int n, int k, const void* lhs, const void* rhs,
                   void* out) {
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
    const WalkOrder walk = SchedulerKnobs(m, n);
    args.scheduler.max_swizzle_size = walk.swizzle;
    args.scheduler.raster_order = walk.raster;
  }

  Gemm gemm;
  if (cutlass::Status s = gemm.can_implement(args); s != cutlass::Status::kSuccess) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string("jaxrl_det_gemm_sm90: CUTLASS cannot run M=") +
                          std::to_string(m) + " N=" + std::to_string(n) + " K=" +
                          std::to_string(k) + " (" + cutlassGetStatusString(s) +
                          "); the contiguous dimension of every operand must be a multiple of "
                          "16 bytes");
  }
  // No workspace: we cannot allocate inside a CUDA-graph capture, and the
  // data-parallel scheduler needs none.
  if (size_t ws = Gemm::get_workspace_size(args); ws != 0) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "jaxrl_det_gemm_sm90: kernel unexpectedly asks for " + std::to_string(ws) +
                          " bytes of workspace");
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
  return ffi::Error::Success();
}

using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// The layouts det_matmul uses: forward NN / NT, dA = dC B^T (NT or NN),
// dB = A^T dC (TN). TT has no caller and is not instantiated.
// Which tile runs (m, n): JAXRL_DET_GEMM_TILE=large|small overrides (tuning).
// Default (measured on an H100, benchmarks/results/gemm_h100.md, session 3):
// SmallTile when the large tiles would occupy fewer than half of the SMs. M=64,
// 4096x4096: 53 -> 126 TFLOP/s; M=256, 4096x4096: 211 -> 514; M=256, K=14336,
// N=4096: 230 -> 638. With 112 or more large tiles (M=256, N=14336; M=1024)
// the large tile was faster.
bool UseSmallTile(int64_t m, int64_t n, int sm_count) {
  if (const char* t = std::getenv("JAXRL_DET_GEMM_TILE"); t != nullptr && *t != '\0') {
    return t[0] == 's';
  }
  const int64_t tiles = ((m + kTileM - 1) / kTileM) * ((n + 255) / 256);
  return tiles * 2 < sm_count;
}

template <class ElementIn, class ElementOut, class LayoutA, class LayoutB>
ffi::Error RunTiled(cudaStream_t stream, int m, int n, int k, const void* lhs, const void* rhs,
                    void* out) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    return CudaError("cudaGetDevice", err);
  }
  if (UseSmallTile(m, n, CachedSmCount(device))) {
    return RunGemm<DetGemm<ElementIn, ElementOut, LayoutA, LayoutB, SmallTile>>(stream, m, n, k,
                                                                                lhs, rhs, out);
  }
  return RunGemm<DetGemm<ElementIn, ElementOut, LayoutA, LayoutB, LargeTile>>(stream, m, n, k,
                                                                              lhs, rhs, out);
}

template <class ElementIn, class ElementOut>
ffi::Error DispatchLayout(cudaStream_t stream, bool lhs_t, bool rhs_t, int m, int n, int k,
                          const void* lhs, const void* rhs, void* out) {
  if (!lhs_t && !rhs_t) {
    return RunTiled<ElementIn, ElementOut, RowMajor, RowMajor>(stream, m, n, k, lhs, rhs, out);
  }
  if (!lhs_t && rhs_t) {
    return RunTiled<ElementIn, ElementOut, RowMajor, ColumnMajor>(stream, m, n, k, lhs, rhs,
                                                                  out);
  }
  if (lhs_t && !rhs_t) {
    // dB = A^T dC is only ever asked for in the input dtype.
    if constexpr (std::is_same_v<ElementIn, ElementOut>) {
      return RunTiled<ElementIn, ElementOut, ColumnMajor, RowMajor>(stream, m, n, k, lhs, rhs,
                                                                    out);
    }
  }
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string("jaxrl_det_gemm_sm90: layout lhs_transposed=") +
                        (lhs_t ? "true" : "false") + ", rhs_transposed=" +
                        (rhs_t ? "true" : "false") +
                        " with this output dtype is not compiled in; supported: NN and NT with "
                        "output = input dtype or float32, TN with output = input dtype");
}

const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::F32:
      return "float32";
    default:
      return "unsupported";
  }
}

ffi::Error DetGemmImpl(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                       ffi::Result<ffi::AnyBuffer> out, bool lhs_transposed, bool rhs_transposed) {
  auto ld = lhs.dimensions();
  auto rd = rhs.dimensions();
  auto od = out->dimensions();
  if (ld.size() != 2 || rd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument(
        "jaxrl_det_gemm_sm90: lhs, rhs and out must be 2-D, got ranks " +
        std::to_string(ld.size()) + ", " + std::to_string(rd.size()) + ", " +
        std::to_string(od.size()));
  }
  const int64_t m = lhs_transposed ? ld[1] : ld[0];
  const int64_t k = lhs_transposed ? ld[0] : ld[1];
  const int64_t k_rhs = rhs_transposed ? rd[1] : rd[0];
  const int64_t n = rhs_transposed ? rd[0] : rd[1];
  if (k != k_rhs || od[0] != m || od[1] != n) {
    return ffi::Error::InvalidArgument(
        "jaxrl_det_gemm_sm90: shapes do not match: lhs K=" + std::to_string(k) + ", rhs K=" +
        std::to_string(k_rhs) + ", out [" + std::to_string(od[0]) + ", " +
        std::to_string(od[1]) + "] but expected [" + std::to_string(m) + ", " +
        std::to_string(n) + "]");
  }
  constexpr int64_t kIntMax = 0x7fffffff;
  if (m > kIntMax || n > kIntMax || k > kIntMax) {
    return ffi::Error::InvalidArgument("jaxrl_det_gemm_sm90: M, N and K must fit in int32");
  }
  if (m == 0 || n == 0) {
    return ffi::Error::Success();  // nothing to write
  }
  if (k == 0) {
    // An empty sum: zeros (the kernel would never store).
    if (cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
        err != cudaSuccess) {
      return CudaError("cudaMemsetAsync", err);
    }
    return ffi::Error::Success();
  }
  const ffi::DataType in_t = lhs.element_type();
  const ffi::DataType out_t = out->element_type();
  if (rhs.element_type() != in_t) {
    return ffi::Error::InvalidArgument(std::string("jaxrl_det_gemm_sm90: lhs is ") +
                                       DtypeName(in_t) + " but rhs is " +
                                       DtypeName(rhs.element_type()));
  }
  const void* a = lhs.untyped_data();
  const void* b = rhs.untyped_data();
  void* d = out->untyped_data();
  // TMA descriptors need 16-byte aligned base addresses; a bad descriptor would
  // fault in the kernel, so refuse here (XLA's buffers are always aligned).
  for (const void* p : {a, static_cast<const void*>(b), static_cast<const void*>(d)}) {
    if (reinterpret_cast<uintptr_t>(p) % kAlignBytes != 0) {
      return ffi::Error::InvalidArgument(
          "jaxrl_det_gemm_sm90: every buffer must be 16-byte aligned for TMA");
    }
  }
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  if (in_t == ffi::DataType::BF16 && out_t == ffi::DataType::BF16) {
    return DispatchLayout<cutlass::bfloat16_t, cutlass::bfloat16_t>(
        stream, lhs_transposed, rhs_transposed, mi, ni, ki, a, b, d);
  }
  if (in_t == ffi::DataType::BF16 && out_t == ffi::DataType::F32) {
    return DispatchLayout<cutlass::bfloat16_t, float>(stream, lhs_transposed, rhs_transposed, mi,
                                                      ni, ki, a, b, d);
  }
  if (in_t == ffi::DataType::F16 && out_t == ffi::DataType::F16) {
    return DispatchLayout<cutlass::half_t, cutlass::half_t>(stream, lhs_transposed,
                                                            rhs_transposed, mi, ni, ki, a, b, d);
  }
  if (in_t == ffi::DataType::F16 && out_t == ffi::DataType::F32) {
    return DispatchLayout<cutlass::half_t, float>(stream, lhs_transposed, rhs_transposed, mi, ni,
                                                  ki, a, b, d);
  }
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string("jaxrl_det_gemm_sm90: unsupported dtypes: inputs ") +
                        DtypeName(in_t) + ", output " + DtypeName(out_t) +
                        "; supported inputs bfloat16/float16 with output of the input dtype or "
                        "float32");
}

}  // namespace
}  // namespace jaxrl_kernels

// Exported from a library built with -fvisibility=hidden (the macro does not
// mark the symbol itself).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JaxrlDetGemmSm90(
    XLA_FFI_CallFrame* call_frame);

// The exported handler. Command-buffer compatible: the handler only enqueues
// work on XLA's stream (no allocation, no synchronization), so XLA can capture
// it into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlDetGemmSm90, jaxrl_kernels::DetGemmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // lhs
                                  .Arg<xla::ffi::AnyBuffer>()  // rhs
                                  .Ret<xla::ffi::AnyBuffer>()  // out
                                  .Attr<bool>("lhs_transposed")
                                  .Attr<bool>("rhs_transposed"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
