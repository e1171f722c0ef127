"""The docs stay a reference that cannot drift from the code (issue 37, item 6).

- every switch of `lorafaas up` is in docs/platform.md's "`lorafaas up`" section;
- every `lorafaas bench` subcommand has its section in docs/performance.md ("## `lorafaas bench NAME`"), and every
  switch of it is in that section;
- docs/ takes at most 150 KB on disk (`du`'s count);
- a link into a Markdown file with a `#fragment`, and a section the code or the tests cite as `docs/X.md, "Title"`,
  name a heading that exists.

That relative links point at existing files inside the repository is tests/unit/test_docs_links.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from lorafaas.cli import command

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOCS_BUDGET_BYTES = 150 * 1024
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _switches(cmd) -> list[str]:
    """Every option spelling of `cmd` (`--strict-compute` and `--no-strict-compute` both), without --help. Typer
    carries its own copy of click, so options are told by their kind, not their class."""
    names = [name for param in cmd.params if param.param_type_name == "option"
             for name in (*param.opts, *param.secondary_opts)]
    return [name for name in names if name != "--help"]


def _section(path: Path, heading: str) -> str:
    """The text under `heading` (a whole line) up to the next heading of the same or a higher level."""
    text = path.read_text()
    level = heading.split(" ", 1)[0]
    lines = text.splitlines()
    assert heading in lines, f"{path.relative_to(ROOT)} has no heading {heading!r}"
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines))
                if lines[i].startswith("#") and len(lines[i].split(" ", 1)[0]) <= len(level)
                and set(lines[i].split(" ", 1)[0]) == {"#"}), len(lines))
    return "\n".join(lines[start:end])


def _mentions(text: str, switch: str) -> bool:
    return re.search(re.escape(switch) + r"(?![\w-])", text) is not None


ROOT_COMMAND = command()
UP = ROOT_COMMAND.commands["up"]
BENCH = ROOT_COMMAND.commands["bench"]


def test_every_switch_of_lorafaas_up_is_in_the_docs() -> None:
    section = _section(DOCS / "platform.md", "## `lorafaas up`")
    switches = _switches(UP)
    assert len(switches) >= 20  # the parser was found: up has over twenty switches today
    missing = [s for s in switches if not _mentions(section, s)]
    assert not missing, f'docs/platform.md, "`lorafaas up`", lacks {missing}'


@pytest.mark.parametrize("name", sorted(BENCH.commands))
def test_every_benchmark_and_each_of_its_switches_is_in_the_docs(name: str) -> None:
    section = _section(DOCS / "performance.md", f"## `lorafaas bench {name}`")
    missing = [s for s in _switches(BENCH.commands[name]) if not _mentions(section, s)]
    assert not missing, f'docs/performance.md, "lorafaas bench {name}", lacks {missing}'


def test_the_benchmarks_are_found() -> None:
    assert {"serve", "attach", "coldstart", "memory", "throughput"} <= set(BENCH.commands)


def test_docs_take_at_most_150_kb_on_disk() -> None:
    """As `du -s docs` counts: the blocks every file and folder under docs/ takes."""
    used = sum(os.lstat(path).st_blocks * 512 for path in [DOCS, *DOCS.rglob("*")])
    assert used <= DOCS_BUDGET_BYTES, f"docs/ takes {used / 1024:.0f} KB; the budget is 150 KB (dated logs: git log)"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (backticks, quotes, dots...), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a `# comment` in a code block is no heading
    return [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]


@pytest.mark.parametrize("document", MARKDOWN, ids=[str(d.relative_to(ROOT)) for d in MARKDOWN])
def test_links_to_a_section_name_an_existing_heading(document: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", document.read_text()):
        if re.match(r"[a-z]+:", target) or "#" not in target:
            continue
        file_part, fragment = target.split("#", 1)
        path = (document.parent / file_part).resolve() if file_part else document
        if path.suffix != ".md" or not path.exists():
            continue  # a missing file is test_docs_links.py's
        slugs = {_slug(h) for h in _headings(path)}
        assert fragment in slugs, f"{document.name} links to {target}, but {path.name} has no such section"


def _has_section(path: Path, title: str) -> bool:
    """A heading that is `title` or starts with it (`Admission` for "## Admission — `admission.py`"), or a paragraph
    that starts with it in bold (`**The step gate**`)."""
    if any(h == title or re.match(re.escape(title) + r"[\s:(—-]", h) for h in _headings(path)):
        return True
    return re.search(r"^\*\*" + re.escape(title) + r"\*\*", path.read_text(), flags=re.M) is not None


CITATION = re.compile(r"docs/(\w+)\.md,\s*\\?\"([^\"\\]+)\\?\"")


def _citations() -> list[tuple[str, str, str]]:
    found = []
    for path in [*sorted((ROOT / "lorafaas").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")),
                 *sorted((ROOT / "lorafaas").rglob("*.yaml")), *MARKDOWN]:
        if path == Path(__file__).resolve():
            continue
        # a citation may run over a line break of a comment or a docstring
        text = re.sub(r"\s*\n\s*#?\s*", " ", path.read_text())
        for doc, title in CITATION.findall(text):
            found.append((str(path.relative_to(ROOT)), doc, title.strip()))
    return found


def test_sections_the_code_cites_exist() -> None:
    citations = _citations()
    assert citations, "no citation found: the pattern no longer matches how the code cites the docs"
    missing = []
    for source, doc, title in citations:
        path = DOCS / f"{doc}.md"
        if not path.exists() or not _has_section(path, title):
            missing.append(f'{source}: docs/{doc}.md, "{title}"')
    assert not missing, "sections cited but not in the docs:\n" + "\n".join(missing)
