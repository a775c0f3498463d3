"""Fused LM-head log-probs: ``linear_logp`` and the pieces its TP form reuses."""

from jaxrl_kernels.linear_logp.api import check_targets as check_targets
from jaxrl_kernels.linear_logp.api import linear_logp as linear_logp
from jaxrl_kernels.linear_logp.merge import VOCAB_TILE as VOCAB_TILE
from jaxrl_kernels.linear_logp.merge import finalize as finalize
from jaxrl_kernels.linear_logp.merge import merge_partials as merge_partials
from jaxrl_kernels.linear_logp.merge import tile_partials as tile_partials
from jaxrl_kernels.linear_logp.vocab_parallel import pad_vocab as pad_vocab
from jaxrl_kernels.linear_logp.vocab_parallel import padded_vocab_size as padded_vocab_size
from jaxrl_kernels.linear_logp.vocab_parallel import (
  vocab_parallel_linear_logp as vocab_parallel_linear_logp,
)
from jaxrl_kernels.linear_logp.vocab_parallel import vocab_parallel_logp as vocab_parallel_logp
