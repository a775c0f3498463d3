"""Pallas kernels: one kernel per file (Triton/interpret and Mosaic GPU lowerings)."""
