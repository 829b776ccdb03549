"""The README and docs/ point only at what the repo holds: every relative link and every
backticked repo path (`tandem/...`, `tests/...`, `examples/...`, `docs/...`) exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
REPO_PATH = re.compile(r"`((?:tandem|tests|examples|docs)/[\w./-]+)`")


def test_links_and_paths_exist():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for target in LINK.findall(text):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: link {target}")
        for path in REPO_PATH.findall(text):
            if not (ROOT / path.rstrip(".")).exists():
                missing.append(f"{page.relative_to(ROOT)}: path {path}")
    assert not missing, "\n".join(missing)


def test_no_reference_to_files_outside_the_repo():
    for page in PAGES:
        text = page.read_text()
        assert "DESIGN.md" not in text and "BENCHMARKS.md" not in text, page.name
