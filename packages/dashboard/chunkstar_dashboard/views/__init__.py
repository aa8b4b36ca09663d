"""The dashboard's pages: Streamlit scripts that ``app.py`` runs through ``st.navigation``.

Each file renders one page when run; none is meant to be imported.
"""
