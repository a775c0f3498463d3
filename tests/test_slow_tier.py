"""tests/slow_in_ci.txt stays true: every node id it lists names a test that pytest collects
(a renamed test or parameter would otherwise drop out of the slow tier and back into CI, or
out of every run), and conftest marks exactly those tests ``slow``."""

import os
import subprocess
import sys

from conftest import slow_in_ci

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_every_listed_id_is_a_collected_test():
  ids = slow_in_ci()
  files = sorted({i.split("::")[0] for i in ids})
  r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                      "-p", "no:cacheprovider", "-m", "slow", *files],
                     capture_output=True, text=True, cwd=ROOT, timeout=600,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  collected = {ln.strip() for ln in r.stdout.splitlines() if "::" in ln}
  missing = sorted(ids - collected)
  assert not missing, f"tests/slow_in_ci.txt names tests that do not exist: {missing[:10]}"
