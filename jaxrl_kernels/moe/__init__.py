"""Mixture-of-experts layers, bitwise: row-local routing that cannot flip, dropless
dispatch on the grouped GEMM, a fixed-order combine, router auxiliary losses."""

from jaxrl_kernels.moe.api import MoEOutput as MoEOutput
from jaxrl_kernels.moe.api import moe_mlp as moe_mlp
from jaxrl_kernels.moe.routing import load_balancing_loss as load_balancing_loss
from jaxrl_kernels.moe.routing import route as route
from jaxrl_kernels.moe.routing import router_probs as router_probs
from jaxrl_kernels.moe.routing import router_z_loss as router_z_loss
