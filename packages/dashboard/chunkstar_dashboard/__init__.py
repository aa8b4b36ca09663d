"""chunkstar_dashboard: the memory-timeline viewer and benchmark pages, a Streamlit app.

    chunkstar-profile view run.csprof [--compare other.csprof] [--bench-db results.sqlite]

``data``, ``charts``, ``bench_data`` and ``bench_charts`` are pure (pandas /
plotly, no Streamlit) and unit-tested; ``loading``, ``bench_loading``, the
script ``app.py`` and the page scripts in ``views/`` are the only Streamlit
code; ``launch`` starts ``streamlit run`` on ``app.py``. Installed with the
``dashboard`` extra (``pip install chunkstar[dashboard]``). Importing this
package imports neither Streamlit nor plotly.
"""

from __future__ import annotations

from chunkstar_dashboard.launch import (
    APP,
    INSTALL_HINT,
    LaunchError,
    MissingDependency,
    check_dependencies,
    check_inputs,
    serve,
    streamlit_command,
)

__all__ = [
    "APP", "INSTALL_HINT", "LaunchError", "MissingDependency", "check_dependencies", "check_inputs", "serve", "streamlit_command",
]  # fmt: skip
