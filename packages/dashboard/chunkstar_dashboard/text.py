"""Untrusted strings inside Streamlit markdown: escaped so they render as they are.

Profile metadata (the model name, the device, ...), file names and error
messages come from files anyone can hand the app. Streamlit renders
``st.markdown``, ``st.caption``, ``st.error`` and friends as markdown with
extras (``$math$``, ``:red[colour]`` directives), so such a string is escaped
before it is put into one. Pure: no Streamlit import, unit-tested.
"""

from __future__ import annotations

import re

__all__ = ["escape_markdown"]

_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")
"""Every ASCII punctuation character: CommonMark lets a backslash make any of them literal."""
_WHITESPACE = re.compile(r"\s+")


def escape_markdown(text: object) -> str:
    """``text`` (``str()`` of it) as markdown that renders literally, on one line.

    Backslash-escapes every ASCII punctuation character, which covers emphasis,
    links, HTML tags and entities, code spans, headings, lists, tables, ``$``
    math and ``:directive[...]``; line breaks become spaces, so the text cannot
    start a block of its own.
    """
    return _PUNCTUATION.sub(r"\\\1", _WHITESPACE.sub(" ", str(text)))
