"""jaxrl_kernels: bitwise batch-invariant kernels for RL post-training in JAX.

Public ops: ``det_matmul`` (deterministic GEMM) and its row-parallel form
``row_parallel_matmul`` (one K order at every TP degree), ``linear_logp`` (fused LM-head
log-prob + entropy) and its vocab-parallel form ``vocab_parallel_linear_logp``,
``causal_attention`` (decode = prefill bitwise), masked global reductions,
``logprob_drift`` diagnostics, the ``rl`` objectives, the ``train`` driver,
``nn`` (Flax modules, the KV-cache sampler and the trainer-side ``score``),
``models`` (Llama / Qwen2 / Qwen3 from Hugging Face folders), ``moe`` (mixture-of-experts
layers: invariant routing, dropless dispatch on the ``grouped_gemm`` per-expert GEMM),
``batch_invariant`` (a transformation that makes any JAX function's reductions fixed-order) and the
fixed-order reductions ``det_sum`` / ``det_cumsum`` / ... it uses.
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
