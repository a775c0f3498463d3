"""XLA FFI custom calls written in CUDA C++ (Hopper, sm_90a).

* ``det_gemm_sm90.cu`` (the FFI handler), ``det_gemm_sm90_kernels.cuh`` and
  ``det_gemm_sm90_tile_*.cu``: the deterministic GEMM (CUTLASS 3.x SM90
  collectives: TMA, wgmma, warp-specialized kernels, three CTA tiles, the K
  tile ``kTileK`` = ``contract.GEMM_TILE_K``).
* ``gemm_ffi.py``: ``matmul_cuda`` and its free knobs ``Config`` (tile,
  CTA walk; passed as FFI attributes), the kernel of ``det_matmul``'s
  ``implementation="cuda"`` backend (``gemm/cuda.py``).
* ``build.py``: ``python -m jaxrl_kernels.custom_calls.build [--out DIR]``.

Importing these modules compiles nothing: the library is built (or found in the
cache) and registered when ``implementation="cuda"`` first runs. See docs/cuda_ffi.md.
"""
