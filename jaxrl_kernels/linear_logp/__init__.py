"""Fused LM-head log-probs: ``linear_logp``, its TP form, its sampler side, and the pieces
they share."""

from jaxrl_kernels.linear_logp.api import BACKENDS as BACKENDS
from jaxrl_kernels.linear_logp.api import VOCAB_TILE as VOCAB_TILE
from jaxrl_kernels.linear_logp.api import check_targets as check_targets
from jaxrl_kernels.linear_logp.api import finalize as finalize
from jaxrl_kernels.linear_logp.api import linear_logp as linear_logp
from jaxrl_kernels.linear_logp.api import merge_partials as merge_partials
from jaxrl_kernels.linear_logp.api import tile_partials as tile_partials
from jaxrl_kernels.linear_logp.config import BackwardConfig as BackwardConfig
from jaxrl_kernels.linear_logp.logits import LogitStats as LogitStats
from jaxrl_kernels.linear_logp.logits import head_logits as head_logits
from jaxrl_kernels.linear_logp.logits import logits_logp as logits_logp
from jaxrl_kernels.linear_logp.logits import logp_from_stats as logp_from_stats
from jaxrl_kernels.linear_logp.vocab_parallel import pad_vocab as pad_vocab
from jaxrl_kernels.linear_logp.vocab_parallel import padded_vocab_size as padded_vocab_size
from jaxrl_kernels.linear_logp.vocab_parallel import (
  vocab_parallel_linear_logp as vocab_parallel_linear_logp,
)
from jaxrl_kernels.linear_logp.vocab_parallel import vocab_parallel_logp as vocab_parallel_logp
