"""Fixed-order reductions (sums and cumulative sums whose bits do not depend on the batch) and
masked reductions with global denominators."""

from jaxrl_kernels.reduce.api import REDUCE_LANES as REDUCE_LANES
from jaxrl_kernels.reduce.api import det_cumlogsumexp as det_cumlogsumexp
from jaxrl_kernels.reduce.api import det_cumprod as det_cumprod
from jaxrl_kernels.reduce.api import det_cumsum as det_cumsum
from jaxrl_kernels.reduce.api import det_prod as det_prod
from jaxrl_kernels.reduce.api import det_sum as det_sum
from jaxrl_kernels.reduce.api import det_sum_scaled_products as det_sum_scaled_products
from jaxrl_kernels.reduce.masked import masked_count as masked_count
from jaxrl_kernels.reduce.masked import masked_mean as masked_mean
from jaxrl_kernels.reduce.masked import masked_sum as masked_sum
