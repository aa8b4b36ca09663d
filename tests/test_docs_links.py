"""The README and docs/ point only at things the repository has.

* every relative markdown link in ``README.md`` and ``docs/*.md`` names an existing
  file, and its ``#anchor`` a heading of that file (GitHub's heading ids);
* every repository path a page names (``runtime/engine.py``, ``benchmarks/gpu_check.py``)
  exists, and every ``Note [name]`` it names is defined under ``packages/``;
* every code reference to the design (``docs/design.md, 'Section'``) names a heading of
  docs/design.md, every ``docs/<page>.md`` the code names exists, and nothing refers to
  the design file that used to live outside the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
CODE_DIRS = ("packages", "tests", "benchmarks", "examples", "dashboards")

_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
# a path inside the repository that a page names: at least one folder, a source file's suffix
_PATH = re.compile(r"(?<![\w./-])((?:\.github/)?[\w-]+(?:/[\w.-]+)*/[\w.-]+\.(?:py|yml|toml))\b")
# where a path a page names may be relative to (design.md names core files from the package)
_ROOTS = [
    REPO,
    REPO / "packages" / "core",
    REPO / "packages" / "core" / "chunkstar",
    REPO / "packages" / "bench",
    REPO / "packages" / "bench" / "chunkstar_bench",
]
_NOTE = re.compile(r"Note \[([^\]]+)\]")
# as tests/bench/test_note_references.py reads a definition: it opens its line (after a
# comment mark or a docstring's quotes) and is followed by ':', '.' or nothing
_NOTE_DEFINITION = re.compile(r'^[ \t]*(?:#[ \t]*|(?:""")?)Note \[([^\]]+)\](?=[:.]|[ \t]*$)', re.MULTILINE)
# "docs/design.md, 'Chunks'", or several: "docs/design.md, 'Chunks' and 'Many processes'"
_DESIGN_REF = re.compile(r"docs/design\.md,\s*(?:#\s*)?('[^']+'(?:\s*(?:#\s*)?(?:and|,)\s*(?:#\s*)?'[^']+')*)")
_SECTION = re.compile(r"'([^']+)'")
_DOC_REF = re.compile(r"\bdocs/([\w.-]+\.md)")
_OUTSIDE = re.compile(r"DESIGN(?:\.md| ?§)|[Dd]esign ?§|\.\./shared|/work/shared")


def _prose(text: str) -> str:
    """The page without its fenced code blocks (a ``#`` comment there is no heading)."""
    return _FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's id for a heading: markup dropped, lower case, punctuation gone, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    ids = set()
    for m in _HEADING.finditer(_prose(page.read_text())):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def _one_line(name: str) -> str:
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", name).strip()


def _code_files() -> list[Path]:
    """The Python files of the repository, this test (whose docstring shows the forms) aside."""
    this = Path(__file__).resolve()
    return [
        p for d in CODE_DIRS for p in sorted((REPO / d).rglob("*.py")) if "__pycache__" not in p.parts and p.resolve() != this
    ]


def test_the_docs_pages_exist() -> None:
    names = {p.name for p in DOCS.glob("*.md")}
    expected = {"design.md", "benchmarks.md", "beyond-host-memory.md", "trainer.md", "distributed.md"}
    expected |= {"profiling.md", "gpu.md", "training.md"}
    assert expected <= names, sorted(expected - names)


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for m in _LINK.finditer(_prose(page.read_text())):
            target = m.group(1)
            if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(REPO)}: {target} (no heading '{anchor}')")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_every_path_a_page_names_exists() -> None:
    missing = [
        f"{page.relative_to(REPO)}: {m.group(1)}"
        for page in PAGES
        for m in _PATH.finditer(page.read_text())
        if not any((root / m.group(1)).exists() for root in _ROOTS)
    ]
    assert not missing, "paths the repository does not have:\n" + "\n".join(missing)


def test_every_note_a_page_names_is_defined() -> None:
    defined = {
        _one_line(m.group(1))
        for p in (REPO / "packages").rglob("*.py")
        for m in _NOTE_DEFINITION.finditer(p.read_text())
    }
    dangling = [
        f"{page.relative_to(REPO)}: Note [{_one_line(m.group(1))}]"
        for page in PAGES
        for m in _NOTE.finditer(page.read_text())
        if _one_line(m.group(1)) not in defined and m.group(1) != "name"  # "Note [name]": the convention itself
    ]
    assert not dangling, "notes defined nowhere under packages/:\n" + "\n".join(dangling)


def test_code_references_to_the_docs_resolve() -> None:
    design = {_one_line(m.group(1)) for m in _HEADING.finditer(_prose((DOCS / "design.md").read_text()))}
    bad = []
    for path in _code_files():
        text = path.read_text()
        where = path.relative_to(REPO)
        for m in _DESIGN_REF.finditer(text):
            for section in _SECTION.findall(m.group(1)):
                if _one_line(section) not in design:
                    bad.append(f"{where}: docs/design.md, '{section}' (no such section)")
        for m in _DOC_REF.finditer(text):
            if not (DOCS / m.group(1)).exists():
                bad.append(f"{where}: docs/{m.group(1)} (no such page)")
    assert not bad, "\n".join(bad)


def test_nothing_points_outside_the_repository() -> None:
    found = [
        f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for path in [*_code_files(), *PAGES]
        for text in [path.read_text()]
        for m in _OUTSIDE.finditer(text)
    ]
    assert not found, "references to a design file outside the repository:\n" + "\n".join(found)
