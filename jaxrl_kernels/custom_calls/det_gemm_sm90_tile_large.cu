// The 128x256 cooperative tile configuration of the deterministic SM90 GEMM
// (det_gemm_sm90_kernels.cuh), in its own translation unit so that nvcc
// compiles the tiles in parallel.
#include "det_gemm_sm90_kernels.cuh"

namespace jaxrl_kernels {
namespace det_gemm {
JAXRL_DET_GEMM_INSTANTIATE(kLarge)
}  // namespace det_gemm
}  // namespace jaxrl_kernels
