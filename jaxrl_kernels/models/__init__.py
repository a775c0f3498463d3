"""Llama / Qwen2 / Qwen3 decoders on the batch-invariant ops, loaded from and saved to
Hugging Face folders (docs/models.md), and sharded over a mesh with the same bits
(``shard``; docs/tp.md)."""

from jaxrl_kernels.models.config import PRESETS as PRESETS
from jaxrl_kernels.models.config import DecoderConfig as DecoderConfig
from jaxrl_kernels.models.config import config as config
from jaxrl_kernels.models.config import from_hf_dict as from_hf_dict
from jaxrl_kernels.models.config import parse_dtype as parse_dtype
from jaxrl_kernels.models.decoder import DecoderLM as DecoderLM
from jaxrl_kernels.models.decoder import canonical_row_chunks as canonical_row_chunks
from jaxrl_kernels.models.hf import from_pretrained as from_pretrained
from jaxrl_kernels.models.hf import preset as preset
from jaxrl_kernels.models.hf import save_pretrained as save_pretrained
from jaxrl_kernels.models.parallel import Parallelism as Parallelism
from jaxrl_kernels.models.parallel import ShardedDecoderLM as ShardedDecoderLM
from jaxrl_kernels.models.parallel import shard as shard
