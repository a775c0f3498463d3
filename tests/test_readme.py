"""The README's quickstart runs as written (its ``python`` blocks, in order, on the CPU)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_quickstart_runs():
  text = (ROOT / "README.md").read_text()
  section = text[text.index("## Quickstart"):text.index("## The commands")]
  blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
  assert len(blocks) == 2, "the quickstart's two python blocks (a folder, then the loop)"
  scope: dict = {}
  for block in blocks:
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
  assert scope["rollout"].tokens.shape[0] == 8
  assert float(scope["metrics"]["ratio_max"]) == 1.0  # on-policy: every ratio exactly 1
