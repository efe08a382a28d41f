"""What ``kvlens dashboard`` runs: ``streamlit run dashboard/serve.py -- ARGS``.

The app (``app.py``, its pages) as an ``st.App`` with the token gate
(:class:`dashboard.gate.TokenGate`) in front of every route Streamlit
serves, the websocket included; Streamlit's own server serves it (its flags
and config, TLS from ``server.sslCertFile``/``server.sslKeyFile``).

The token comes from ``$KVLENS_TOKEN`` (``kvlens dashboard`` sets it from
``$KVLENS_TOKEN`` or ``--token-file``; never a command-line argument, which
``ps`` shows to every user). It is taken out of this process's environment
as soon as it is read, so a page cannot show it. No token: the gate lets
everything through (``kvlens dashboard`` allows that on loopback, or with
``--insecure``). ``streamlit run dashboard/app.py`` still runs the app
without any gate.
"""

from __future__ import annotations

import os

import streamlit as st
from starlette.middleware import Middleware

from dashboard.gate import TokenGate
from kvrecord.config import TOKEN_ENV

_token = os.environ.pop(TOKEN_ENV, "").strip().encode() or None

app = st.App("app.py", middleware=[Middleware(TokenGate, token=_token)])
