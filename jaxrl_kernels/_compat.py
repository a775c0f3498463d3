"""Compatibility shims across the jax versions we support (0.10.2 on CPU CI, 0.11.2 on GPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

try:  # jax >= 0.7 exposes shard_map at the top level, with `check_vma`.
  from jax import shard_map as _shard_map

  _TOP_LEVEL = True
except ImportError:  # pragma: no cover - older jax: the experimental one, with `check_rep`.
  from jax.experimental.shard_map import shard_map as _shard_map

  _TOP_LEVEL = False


def shard_map(f: Callable, *, mesh: jax.sharding.Mesh, in_specs: Any, out_specs: Any,
              check_vma: bool = True) -> Callable:
  """``jax.shard_map`` where present, else ``jax.experimental.shard_map.shard_map``.

  ``check_vma`` maps onto the old ``check_rep`` flag of the experimental version.
  """
  if _TOP_LEVEL:
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
  return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,  # pragma: no cover
                    check_rep=check_vma)
