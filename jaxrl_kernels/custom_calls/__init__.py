"""XLA FFI custom calls written in CUDA C++ (Hopper, sm_90a).

* ``det_gemm_sm90.cu``: the deterministic GEMM (CUTLASS 3.x SM90 collectives:
  TMA, wgmma, warp-specialized cooperative kernel, fixed 128x128x64 tile).
* ``gemm_ffi.py``: ``matmul_cuda``, the ``implementation="cuda"`` backend of
  ``det_matmul``; builds and registers the library on first use.
* ``build.py``: ``python -m jaxrl_kernels.custom_calls.build [--out DIR]``.

Nothing here is imported by ``import jaxrl_kernels``: the library is compiled
only when ``implementation="cuda"`` is first used. See docs/cuda_ffi.md.
"""
