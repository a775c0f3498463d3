"""``python -m jaxrl_kernels``: the command line, :func:`jaxrl_kernels.cli.main`."""
import sys

from jaxrl_kernels.cli import main

if __name__ == "__main__":
  sys.exit(main())
