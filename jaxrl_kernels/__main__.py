"""``python -m jaxrl_kernels`` / ``jaxrl-kernels``: bitwise on-policy parity on this device.

Commands:

* ``parity`` (the default): the kernel batch-invariance section, then a KV-cache
  sampler vs trainer-forward comparison of every sampled token's log-prob on
  ``TinyCausalLM``, for the stock XLA path and for jaxrl_kernels
  (:mod:`jaxrl_kernels.parity`). Exit status 0 iff jaxrl_kernels is bitwise.
* ``kernels``: the kernel section alone.
* ``grpo-demo``: a short GRPO run (``jaxrl_kernels.demos.grpo_demo``; the
  arguments after ``grpo-demo`` are its own, see ``grpo-demo --help``).
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxrl_kernels import _backend, parity

COMMANDS = ("parity", "kernels", "grpo-demo")


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  # Before JAX starts its backends: interpreted kernels on the CPU without FMA contraction
  # (see jaxrl_kernels/_backend.py; a --xla_cpu_max_isa of the user's own stands).
  os.environ["XLA_FLAGS"] = _backend.no_fma_xla_flags()
  if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
    argv = ["parity", *argv]
  if argv[0] == "grpo-demo":  # its own parser: every later argument is the demo's
    from jaxrl_kernels.demos import grpo_demo
    rc = grpo_demo.main(argv[1:])
    return rc if isinstance(rc, int) else 0
  p = argparse.ArgumentParser(prog="jaxrl-kernels", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  parity.add_parity_arguments(sub.add_parser(
      "parity", help="kernel invariance + sampler vs trainer log-probs (default)"))
  parity.add_kernel_arguments(sub.add_parser("kernels", help="kernel batch invariance only"))
  sub.add_parser("grpo-demo", help="a short GRPO run on a toy task (arguments: grpo-demo -h)")
  args = p.parse_args(argv)
  if args.command == "kernels":
    return parity.run_kernels(args)
  return parity.run_parity(args)


if __name__ == "__main__":
  sys.exit(main())
