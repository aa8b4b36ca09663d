"""Every ``Note [name]`` the bench package refers to is defined somewhere under ``packages/``, under that exact name."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2] / "packages"

_REFERENCE = re.compile(r"Note \[([^\]]+)\]")
# a definition opens its line (after a comment mark or a docstring's quotes) and is followed by ':', '.' or nothing
_DEFINITION = re.compile(r'^[ \t]*(?:#[ \t]*|(?:""")?)Note \[([^\]]+)\](?=[:.]|[ \t]*$)', re.MULTILINE)


def _name(raw: str) -> str:
    """A name as written, a line break inside it (and the next line's comment mark) read as one space."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", raw).strip()


def test_every_note_the_bench_refers_to_is_defined_under_that_name() -> None:
    sources = {path: path.read_text() for path in PACKAGES.rglob("*.py")}
    defined = {_name(m.group(1)) for text in sources.values() for m in _DEFINITION.finditer(text)}
    bench = PACKAGES / "bench"
    dangling = [
        f"{path.relative_to(PACKAGES)}:{text.count(chr(10), 0, m.start()) + 1}: Note [{_name(m.group(1))}]"
        for path, text in sorted(sources.items())
        if path.is_relative_to(bench)
        for m in _REFERENCE.finditer(text)
        if _name(m.group(1)) not in defined
    ]
    assert not dangling, "references to no Note of that name:\n" + "\n".join(dangling)
