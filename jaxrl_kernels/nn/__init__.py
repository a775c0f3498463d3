"""Flax NNX modules: thin holders of parameters over the deterministic ops."""

from jaxrl_kernels.nn import checkpoint as checkpoint
from jaxrl_kernels.nn.linear import DetLinear as DetLinear
from jaxrl_kernels.nn.lm_head import LMHead as LMHead
from jaxrl_kernels.nn.lm_head import LogitStats as LogitStats
from jaxrl_kernels.nn.lm_head import head_logits as head_logits
from jaxrl_kernels.nn.lm_head import logits_logp as logits_logp
from jaxrl_kernels.nn.lm_head import logp_from_stats as logp_from_stats
from jaxrl_kernels.nn.norm import add_rms_norm as add_rms_norm
from jaxrl_kernels.nn.norm import rms_norm as rms_norm
from jaxrl_kernels.nn.protocol import CausalLM as CausalLM
from jaxrl_kernels.nn.protocol import Documents as Documents
from jaxrl_kernels.nn.protocol import KVCache as KVCache
from jaxrl_kernels.nn.protocol import documents as documents
from jaxrl_kernels.nn.sampler import SampleResult as SampleResult
from jaxrl_kernels.nn.sampler import sample as sample
from jaxrl_kernels.nn.sampler import score as score
from jaxrl_kernels.nn.tiny_lm import TinyCausalLM as TinyCausalLM
from jaxrl_kernels.nn.tiny_lm import TinyLMConfig as TinyLMConfig
