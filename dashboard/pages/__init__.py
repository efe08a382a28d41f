"""The dashboard's pages, one module each (Overview, Compare, Traces).

Each is a Streamlit page script registered by ``dashboard/app.py`` with
``st.Page("pages/<name>.py")``: it defines a ``main()`` that draws the page
and runs it (through ``ui.run_page``) only when Streamlit runs the file as
the page (``__name__ == "__main__"``), so importing a page runs nothing.
"""
