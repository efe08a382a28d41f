"""kvlens Streamlit dashboard: ``app.py`` draws, ``data.py`` loads."""
