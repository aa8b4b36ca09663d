"""The chunkstar profile dashboard's library: data shaping, figures, loading.

``data`` and ``charts`` are pure (pandas / plotly) and unit-tested; ``loading``
and the page scripts in ``dashboards/views/`` are the only Streamlit code.
Start the app with ``streamlit run dashboards/app.py -- --profile PATH``.
"""
