"""``batch_invariant``: rewrite a JAX function so that its reductions run in a fixed order."""

from jaxrl_kernels.transform.api import batch_invariant as batch_invariant
from jaxrl_kernels.transform.interpreter import NotRewrittenWarning as NotRewrittenWarning
