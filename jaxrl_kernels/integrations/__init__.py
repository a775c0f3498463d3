"""Adapters to RL frameworks, one module per framework, each behind its own extra.

* :mod:`jaxrl_kernels.integrations.tunix`: a rollout, a reference scorer and a GRPO learner
  for Tunix's ``RLCluster`` on :class:`~jaxrl_kernels.models.DecoderLM`
  (``pip install jaxrl_kernels[tunix]``).

Nothing in the library imports this package, and this file imports no framework: each
module imports its framework when it is imported itself.
"""
