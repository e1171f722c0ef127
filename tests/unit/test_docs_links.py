"""README and docs link only to files inside the repository (a clone without `../shared` beside it must read whole)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(d.relative_to(ROOT)) for d in DOCUMENTS])
def test_relative_links_resolve_inside_the_repository(document: Path) -> None:
    for target in LINK.findall(document.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor
        path = (document.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{document.name} links outside the repository: {target}"
        assert path.exists(), f"{document.name} links to a missing file: {target}"
