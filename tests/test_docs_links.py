"""Every relative markdown link in README.md, docs/ and benchmarks/results/ resolves to a file."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# [text](target) and ![alt](target); the target ends at whitespace or ')'.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _markdown_files():
  files = [ROOT / "README.md"]
  for folder in ("docs", "benchmarks/results"):
    files += sorted((ROOT / folder).glob("*.md"))
  return [f for f in files if f.exists()]


def _relative_targets(text):
  for match in _LINK.finditer(text):
    target = match.group(1)
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
      continue  # a URL (http:, mailto:, ...) or an anchor in the same file
    yield target.split("#", 1)[0]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
  missing = [t for t in _relative_targets(path.read_text()) if not (path.parent / t).exists()]
  assert not missing, f"{path.relative_to(ROOT)}: links to missing files {missing}"


def test_the_link_pattern_finds_links_and_skips_urls():
  text = "see [a](docs/x.md#s), ![img](img/p.png \"t\"), [u](https://e.org/y), [h](#top)"
  assert list(_relative_targets(text)) == ["docs/x.md", "img/p.png"]


def test_a_missing_target_is_reported(tmp_path):
  doc = tmp_path / "d.md"
  doc.write_text("[gone](nowhere.md)")
  assert [t for t in _relative_targets(doc.read_text()) if not (doc.parent / t).exists()] == [
    "nowhere.md"
  ]
