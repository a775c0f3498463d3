"""Demos run by the main command (``jaxrl-kernels grpo-demo``)."""
