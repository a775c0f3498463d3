"""Flax NNX modules: thin holders of parameters over the deterministic ops."""

from jaxrl_kernels.nn.linear import DetLinear as DetLinear
