"""Reading profile files for the app: cached parsing and the "which profile" widgets.

Parsing goes through ``chunkstar_profiler.load`` (the pages get its
``Profile`` as it is) and is cached by ``st.cache_data``: a file on disk by
(path, mtime, size), so an edited file is read again; an upload by its bytes. A file that is missing, not a profile, or
hostile (the profiler refuses those with ``ProfileFormatError``) becomes a
``ProfileLoadError`` whose text the page shows, escaped (no traceback).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import chunkstar_profiler
import streamlit as st
from chunkstar_profiler import Profile

from .data import prediction_note
from .text import escape_markdown

__all__ = [
    "Loaded", "ProfileLoadError", "current_profile", "load_path", "load_upload", "profile_picker", "set_current", "show_error",
    "show_prediction",
]  # fmt: skip

_CURRENT = "chunkstar_current_profile"
"""Session-state key of the ``Loaded`` that the main script picked this run."""


class ProfileLoadError(Exception):
    """A profile file could not be read; the message is meant for the user."""


@dataclass(frozen=True)
class Loaded:
    """Outcome of picking a profile: a profile, an error to show, or neither (nothing chosen)."""

    profile: Profile | None = None
    error: str | None = None


@st.cache_data(show_spinner="Reading profile...", max_entries=16)
def _parse_path(path: str, mtime_ns: int, size: int) -> Profile:
    del mtime_ns, size  # part of the cache key only
    return chunkstar_profiler.load(path)


@st.cache_data(show_spinner="Reading profile...", max_entries=16)
def _parse_upload(data: bytes, name: str) -> Profile:
    # Read from the bytes: the upload's name is the user's, never a path to write to.
    return chunkstar_profiler.load(data, name=name)


def load_path(path: str | Path) -> Profile:
    """Parse the profile at ``path`` (cached); raises ``ProfileLoadError`` with a readable message."""
    p = Path(path).expanduser()
    try:
        stat = p.stat()
    except OSError as err:
        raise ProfileLoadError(f"Cannot open {str(path)!r}: {err.strerror or err}") from None
    if not p.is_file():
        raise ProfileLoadError(f"{str(path)!r} is not a file.")
    try:
        return _parse_path(str(p.resolve()), stat.st_mtime_ns, stat.st_size)
    except chunkstar_profiler.ProfileFormatError as err:
        raise ProfileLoadError(f"{p.name} is not a readable chunkstar profile: {err}") from None
    except OSError as err:
        raise ProfileLoadError(f"Cannot read {str(path)!r}: {err}") from None
    except MemoryError:
        raise ProfileLoadError(f"{p.name} is too large to load: this process ran out of memory reading it.") from None


def load_upload(upload: Any) -> Profile:
    """Parse an ``st.file_uploader`` upload (cached by its bytes)."""
    name = str(upload.name)
    try:
        return _parse_upload(upload.getvalue(), name)
    except chunkstar_profiler.ProfileFormatError as err:
        raise ProfileLoadError(f"{name} is not a readable chunkstar profile: {err}") from None
    except MemoryError:
        raise ProfileLoadError(f"{name} is too large to load: this process ran out of memory reading it.") from None


def profile_picker(key: str, label: str, container: Any = st) -> Loaded:
    """A path box and an uploader (widget keys ``{key}_path`` / ``{key}_upload``); an upload wins.

    ``label`` names the profile ("Profile", "Profile B"). Set
    ``st.session_state[f"{key}_path"]`` before the first call to prefill the path.
    """
    path = container.text_input(f"{label}: file path", key=f"{key}_path", placeholder="/path/to/run.csprof")
    upload = container.file_uploader(f"...or upload {label}", key=f"{key}_upload")
    try:
        if upload is not None:
            return Loaded(profile=load_upload(upload))
        if path and path.strip():
            return Loaded(profile=load_path(path.strip()))
    except ProfileLoadError as err:
        return Loaded(error=str(err))
    return Loaded()


def set_current(loaded: Loaded) -> None:
    """Record the profile the sidebar picked, for the pages of this run."""
    st.session_state[_CURRENT] = loaded


def current_profile() -> Profile:
    """The picked profile; otherwise shows why there is none and stops the page. A predicted
    profile gets a note saying so (:func:`show_prediction`), on every page that shows it."""
    loaded: Loaded = st.session_state.get(_CURRENT, Loaded())
    if loaded.error is not None:
        show_error(loaded.error)
        st.stop()
    if loaded.profile is None:
        st.info(
            "No profile loaded. Give a profile file's path or upload one in the sidebar, "
            "or start the app with `chunkstar-profile view PATH`.\n\n"
            "Profiles are written by `chunkstar_profiler.Profiler(engine)` (`prof.save(path)`)."
        )
        st.stop()
    show_prediction(loaded.profile)
    return loaded.profile


def show_prediction(p: Profile, label: str = "", container: Any = st) -> None:
    """Say that ``p`` is a predicted profile (a dry run's step on the time model's clock), when it is one;
    ``label`` ("B: ") names it where a page shows two."""
    note = prediction_note(p)
    if note is not None:
        container.info(label + note, icon=":material/online_prediction:")


def show_error(message: str, container: Any = st) -> None:
    """``st.error`` with ``message`` escaped: it names files and fields the user supplied."""
    container.error(escape_markdown(message))
