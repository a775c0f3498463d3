"""The command line, ``python -m jaxrl_kernels`` / ``jaxrl-kernels``: bitwise on-policy parity
on this device.

The commands are listed in :data:`DESCRIPTION` (``jaxrl-kernels --help``); ``parity`` and
``kernels`` live in :mod:`jaxrl_kernels.cli.parity` (the sharded-model section in
:mod:`~jaxrl_kernels.cli.parity_tp`, a user's model function in
:mod:`~jaxrl_kernels.cli.model_fn`), ``grpo-demo`` in :mod:`jaxrl_kernels.cli.grpo_demo`
(with a parser of its own: every argument after ``grpo-demo`` is the demo's). This package
imports the library; the library never imports it.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

import jax

from jaxrl_kernels import _backend
from jaxrl_kernels._version import __version__
from jaxrl_kernels.cli import parity

COMMANDS = ("parity", "kernels", "grpo-demo")

# Plain text: argparse prints it as it is.
DESCRIPTION = """\
Bitwise on-policy parity of jaxrl_kernels on this device. Without a command it runs
parity. Exit status: 0 iff jaxrl_kernels is bitwise, 1 if it is not, 2 for arguments
that cannot run here. Options of a command: jaxrl-kernels COMMAND -h
"""


def _parser() -> argparse.ArgumentParser:
  p = parity.Parser(prog="jaxrl-kernels", description=DESCRIPTION,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("-V", "--version", action="version",
                 version=f"jaxrl-kernels {__version__} (jax {jax.__version__})")
  sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
  fmt = argparse.ArgumentDefaultsHelpFormatter
  parity.add_parity_arguments(sub.add_parser(
      "parity", help="kernel batch invariance, then every sampled token's log-prob from the "
                     "KV-cache sampler vs the trainer's forward on TinyCausalLM, stock XLA "
                     "path and jaxrl_kernels (the default command); --rollout-tp / "
                     "--train-fsdp: a DecoderLM sampled tensor-parallel, trained fully "
                     "sharded; --model-fn: a user's model function",
      description="Kernel batch invariance, then sampler vs trainer log-probs. With "
                  "--rollout-tp N / --train-fsdp M (or a DecoderLM --model): only the "
                  "sharded-model section (sampled TP = N, scored FSDP = M and unsharded). "
                  "With --model-fn: only the user's model function under batch_invariant.",
      formatter_class=fmt))
  parity.add_kernel_arguments(sub.add_parser(
      "kernels", help="kernel batch invariance only",
      description="Kernel batch invariance only.", formatter_class=fmt))
  sub.add_parser("grpo-demo", add_help=False,
                 help="a short GRPO run on a toy task, both paths' drift at every step")
  return p


def _implementation(argv: list[str]) -> str | None:
  """The ``--implementation`` among ``argv`` (None when absent), read before JAX starts."""
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--implementation", default=None)
  return pre.parse_known_args(argv)[0].implementation


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  p = _parser()
  if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "-V",
                                                                "--version")):
    argv = ["parity", *argv]
  elif argv[0] not in COMMANDS and not argv[0].startswith("-"):
    close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
    p.error(f"unknown command {argv[0]!r}" + (f"; did you mean {close[0]!r}?" if close else "")
            + f" (commands: {', '.join(COMMANDS)})")
  if parity.needs_no_fma_flag(_implementation(argv[1:])):
    # Before JAX starts its backends: interpreted kernels on the CPU without FMA contraction
    # (see jaxrl_kernels/_backend.py; a --xla_cpu_max_isa of the user's own stands).
    os.environ["XLA_FLAGS"] = _backend.no_fma_xla_flags()
  if argv[0] == "grpo-demo":  # its own parser: every later argument is the demo's
    from jaxrl_kernels.cli import grpo_demo
    rc = grpo_demo.main(argv[1:])
    return rc if isinstance(rc, int) else 0
  args = p.parse_args(argv)
  if args.command == "kernels":
    return parity.run_kernels(args)
  return parity.run_parity(args)
