"""kvlens Streamlit dashboard: ``app.py`` (entry and navigation), ``pages/``
(one module per page), ``charts.py`` (Altair), ``loaders.py`` (cached
loaders) over ``data.py`` (the store) and ``prom.py`` (Prometheus)."""
