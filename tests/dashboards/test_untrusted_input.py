"""What a user hands the app: bad uploads and paths give an error on every page, never a traceback;
strings from a profile (metadata, file names) are escaped, so markdown in them renders literally."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from chunkstar_dashboard.text import escape_markdown
from tests.profiler._hostile import FLAGS, METHOD, SMALL_META, patch_header, rebuild, small_profile, with_manifest

from .conftest import APP

PAGES = ("views/memory.py", "views/chunks.py", "views/operators.py", "views/compare.py")
MEMBER = "tables/moves/nbytes.npy"
MARKDOWN = "**bold** _it_ [link](http://example.com) <b>html</b> &amp; $x^2$ :red[red] `tick` # h"
"""A string that renders as something else wherever markdown is not escaped."""


def _render(source: str) -> str:
    markdown_it = pytest.importorskip("markdown_it")
    return str(markdown_it.MarkdownIt("commonmark").render(source))


def _literal(text: str) -> str:
    """``text`` as CommonMark renders plain characters."""
    return html.escape(text, quote=False).replace('"', "&quot;")


def _assert_no_traceback(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small readable profile from hand-made columns (no engine run: these tests are about the files)."""
    return small_profile(tmp_path_factory.mktemp("small") / "small.csprof")


@pytest.fixture(scope="module")
def bad_profiles(profile_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Profiles made unreadable in ways the profiler's reader used to let through as tracebacks."""
    root = tmp_path_factory.mktemp("bad")
    encrypted = rebuild(profile_path, root / "encrypted.csprof", {})
    patch_header(encrypted, MEMBER, FLAGS, 0x1)
    method = rebuild(profile_path, root / "method99.csprof", {})
    patch_header(method, MEMBER, METHOD, 99)
    return {
        "encrypted member": encrypted,
        "compression method 99": method,
        "meta a list": with_manifest(profile_path, root / "meta_list.csprof", lambda m: m.update(meta=["x"])),
        "rows a string": with_manifest(profile_path, root / "rows.csprof", lambda m: m["tables"]["moves"].update(rows="3")),
        "budget a string": with_manifest(profile_path, root / "budget.csprof", lambda m: m["meta"].update(budget_bytes="lots")),
    }


@pytest.fixture(scope="module")
def markdown_profile(profile_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A readable profile whose file name and metadata strings are full of markdown."""
    path = tmp_path_factory.mktemp("md") / "[f](http://e.com) *x* $y$.csprof"
    return small_profile(path, meta={**SMALL_META, "model_name": MARKDOWN, "precision": "_bf16_", "device": "<i>cpu</i>"})


@pytest.mark.parametrize(
    "text",
    [MARKDOWN, "plain words", "C:\\path\\*file*", "line one\n\n# two\n    three", "1. item", "- item", "| a | b |", "~~gone~~", "x<!-- c -->y"],
)
def test_escaped_markdown_renders_literally(text: str) -> None:
    escaped = escape_markdown(text)
    assert _render(escaped) == f"<p>{_literal(' '.join(text.split()))}</p>\n"
    assert not re.search(r"(?<!\\)[$:]", escaped)  # Streamlit's math and directives: no bare $ or :


@pytest.mark.parametrize("kind", ["encrypted member", "compression method 99", "meta a list", "rows a string", "budget a string"])
def test_a_bad_upload_shows_an_error_on_every_page(kind: str, bad_profiles: dict[str, Path]) -> None:
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    at.file_uploader(key="profile_upload").upload(bad_profiles[kind].name, bad_profiles[kind].read_bytes()).run()
    for page in PAGES:
        at.switch_page(page).run()
        _assert_no_traceback(at)
        assert len(at.error) == 1, page
        assert at.error[0].value.startswith(escape_markdown(f"{bad_profiles[kind].name} is not a readable chunkstar profile")), page
        assert not at.get("plotly_chart")


def test_an_upload_named_like_a_directory_is_not_written_anywhere(profile_path: Path) -> None:
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    at.file_uploader(key="profile_upload").upload("..", b"not a profile").run()
    _assert_no_traceback(at)
    assert len(at.error) == 1 and "not a readable chunkstar profile" in at.error[0].value
    at.file_uploader(key="profile_upload").upload("..", profile_path.read_bytes()).run()
    _assert_no_traceback(at)
    assert not at.error and len(at.get("plotly_chart")) == 1


def test_bad_paths_show_an_error_on_every_page(bad_profiles: dict[str, Path], tmp_path: Path) -> None:
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    for path, expected in (
        (tmp_path, "is not a file"),
        (tmp_path / "missing.csprof", "Cannot open"),
        (bad_profiles["encrypted member"], "is encrypted"),
        (bad_profiles["rows a string"], "moves.rows"),
    ):
        at.text_input(key="profile_path").input(str(path)).run()
        for page in PAGES:
            at.switch_page(page).run()
            _assert_no_traceback(at)
            assert len(at.error) == 1 and escape_markdown(expected) in at.error[0].value, (path, page)


def test_a_bad_second_profile_on_the_compare_page(profile_path: Path, bad_profiles: dict[str, Path]) -> None:
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["profile_path"] = str(profile_path)
    at.run().switch_page("views/compare.py").run()
    bad = bad_profiles["meta a list"]
    at.file_uploader(key="compare_upload").upload(bad.name, bad.read_bytes()).run()
    _assert_no_traceback(at)
    assert len(at.error) == 1 and "meta" in at.error[0].value and "expected an object" in at.error[0].value


def test_markdown_in_profile_metadata_is_escaped(markdown_profile: Path) -> None:
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["profile_path"] = str(markdown_profile)
    at.run()
    _assert_no_traceback(at)
    assert not at.error
    summary = _render(at.sidebar.caption[0].value)
    for text in (markdown_profile.name, MARKDOWN, "_bf16_", "<i>cpu</i>"):
        assert _literal(text) in summary, text
    assert summary.count("<strong>") == 1  # the file name's own bold, nothing from the file
    assert not re.search(r"<(em|a|b|i|code|h1)[ >]", summary)
    # the compare page shows both names in markdown too
    at.switch_page("views/compare.py").run()
    at.text_input(key="compare_path").input(str(markdown_profile)).run()
    _assert_no_traceback(at)
    name = escape_markdown(markdown_profile.name)
    shown = [_render(m.value) for m in (*at.caption, *at.markdown) if name in m.value]
    assert len(shown) >= 3  # "A: ..." caption and the two timeline headings
    for rendered in shown:
        assert _literal(markdown_profile.name) in rendered
        assert not re.search(r"<(em|a|b|i|code)[ >]", rendered)


def test_the_path_box_never_shows_what_a_file_that_is_not_a_profile_holds(tmp_path: Path) -> None:
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$hunter2:19000:0:99999:7:::\n")  # /etc/shadow's shape: the server may read it, a visitor must not
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    at.text_input(key="profile_path").input(str(secret)).run()
    _assert_no_traceback(at)
    assert [e.value for e in at.error] == [escape_markdown(f"shadow is not a readable chunkstar profile: {secret}: not a chunkstar profile")]
