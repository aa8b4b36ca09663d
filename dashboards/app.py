"""The checkout's entry to the profile dashboard, for ``streamlit run``.

    streamlit run dashboards/app.py -- --profile run.csprof [--compare other.csprof] [--bench-db results.sqlite]

The app itself is the installed package ``chunkstar_dashboard`` (its source is
``packages/dashboard/``); ``chunkstar-profile view run.csprof`` starts the same
app without a checkout. This file only hands the arguments after ``--`` to it.
"""

from __future__ import annotations

import sys
from pathlib import Path

_SOURCE = Path(__file__).resolve().parents[1] / "packages" / "dashboard"
if _SOURCE.is_dir() and str(_SOURCE) not in sys.path:  # the checkout's code, even where it was never pip-installed
    sys.path.insert(0, str(_SOURCE))

from chunkstar_dashboard.app import main, script_args  # noqa: E402

main(script_args(__file__))
