"""Rewrites tests/golden_digests.json for the implementations this machine runs.

    PYTHONPATH=. python tests/golden_update.py [--out PATH] [--implementations cpu interpret]

On the CPU it computes the ``"cpu"`` and ``"interpret"`` digests, on a GPU ``"mosaic"``
(Hopper) and ``"triton"``; the other entries of the file are kept. A change of digests is a
change of bits: say why in the commit.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

# The suite's XLA flags (no FMA contraction; -O0 on a CPU-only run) before jax starts: the
# digests are the bits the tests compute.
import conftest  # noqa: E402, F401
import golden_cases  # noqa: E402
import jax  # noqa: E402

PATH = pathlib.Path(__file__).parent / "golden_digests.json"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=pathlib.Path, default=PATH)
  p.add_argument("--implementations", nargs="+", default=None)
  args = p.parse_args(argv)
  impls = args.implementations or (golden_cases.GPU_IMPLEMENTATIONS
                                   if jax.default_backend() == "gpu"
                                   else golden_cases.CPU_IMPLEMENTATIONS)
  digests = json.loads(PATH.read_text()) if PATH.exists() else {}
  for op, impl, dtype in golden_cases.keys(impls):
    name = golden_cases.key_name(op, impl, dtype)
    try:
      new = golden_cases.compute(op, impl, dtype)
    except Exception as e:  # noqa: BLE001 - report every case, then fail
      print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
      continue
    old = digests.get(name)
    print(f"{name}: {'same' if old == new else 'NEW' if old is None else 'CHANGED'}",
          flush=True)
    digests[name] = new
  args.out.write_text(json.dumps(dict(sorted(digests.items())), indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
