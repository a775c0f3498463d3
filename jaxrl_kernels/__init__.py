"""jaxrl_kernels: bitwise batch-invariant kernels for RL post-training in JAX.

Ops: ``det_matmul`` / ``row_parallel_matmul``, ``linear_logp`` / ``vocab_parallel_linear_logp``
(the fused LM head), ``causal_attention``, ``grouped_gemm`` and ``moe`` (mixture-of-experts),
fixed-order and masked reductions, ``batch_invariant``; ``nn`` (modules, sampler, ``score``),
``models`` (Hugging Face decoders), ``rl`` objectives, ``train``, ``logprob_drift``.
"""

from jaxrl_kernels import attention as attention
from jaxrl_kernels import grouped_gemm as grouped_gemm
from jaxrl_kernels import models as models
from jaxrl_kernels import moe as moe
from jaxrl_kernels import nn as nn
from jaxrl_kernels import rl as rl
from jaxrl_kernels import train as train
from jaxrl_kernels._version import __version__ as __version__
from jaxrl_kernels.attention import causal_attention as causal_attention
from jaxrl_kernels.diagnostics import DriftReport as DriftReport
from jaxrl_kernels.diagnostics import logprob_drift as logprob_drift
from jaxrl_kernels.gemm import det_matmul as det_matmul
from jaxrl_kernels.gemm import row_parallel_matmul as row_parallel_matmul
from jaxrl_kernels.linear_logp import check_targets as check_targets
from jaxrl_kernels.linear_logp import linear_logp as linear_logp
from jaxrl_kernels.linear_logp import pad_vocab as pad_vocab
from jaxrl_kernels.linear_logp import vocab_parallel_linear_logp as vocab_parallel_linear_logp
from jaxrl_kernels.linear_logp import vocab_parallel_logp as vocab_parallel_logp
from jaxrl_kernels.reduce import det_cumlogsumexp as det_cumlogsumexp
from jaxrl_kernels.reduce import det_cumprod as det_cumprod
from jaxrl_kernels.reduce import det_cumsum as det_cumsum
from jaxrl_kernels.reduce import det_prod as det_prod
from jaxrl_kernels.reduce import det_sum as det_sum
from jaxrl_kernels.reduce.masked import masked_count as masked_count
from jaxrl_kernels.reduce.masked import masked_mean as masked_mean
from jaxrl_kernels.reduce.masked import masked_sum as masked_sum
from jaxrl_kernels.transform import NotRewrittenWarning as NotRewrittenWarning
from jaxrl_kernels.transform import batch_invariant as batch_invariant
