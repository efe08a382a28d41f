"""kvlens dashboard (Streamlit): push vs pull KV handoff, live and from the
benchmark grid, and per-request P+D waterfalls.

Run it with ``kvlens dashboard [--store PATH|postgresql://...] [--prometheus URL]``, or
directly: ``streamlit run dashboard/app.py -- --store PATH`` (the packages
come from the editable install, ``make setup``).

Streamlit reads its settings from ``.streamlit/config.toml`` in the
*current working directory* (then ``~/.streamlit/config.toml``). The
repository's ``.streamlit/config.toml`` binds loopback only (127.0.0.1),
shows no tracebacks or exception text in the page
(``client.showErrorDetails = "none"``), runs headless and sends no usage
statistics; so run ``streamlit run dashboard/app.py`` from the repository
root, or pass the same settings as flags (``--server.address 127.0.0.1
--client.showErrorDetails none``): started from elsewhere, Streamlit binds
every interface and shows full tracebacks. ``kvlens dashboard`` does not
depend on the directory it is started from: it runs Streamlit from the
repository root and passes these settings as flags, which win over any
file.

This file is the entry only: the page navigation and the sidebar. Each page
is a module in ``dashboard/pages/``; loads go through the cached loaders of
``dashboard/loaders.py`` (over ``data.py`` and ``prom.py``), charts are in
``charts.py``. Each page has its URL (``/overview``, ``/compare``,
``/traces``); the root URL opens the Overview, and ``?page=<name>`` opens that
page with the other query params (the Overview links use it).
"""

from __future__ import annotations

import streamlit as st

from dashboard.ui import NAV_KEY, Config, parse_config

__all__ = ["Config", "DEFAULT_PAGE", "PAGES", "main", "parse_config"]

#: url path -> (title, icon, page script relative to this file); the first is the default page.
PAGES = {
    "overview": ("Overview", ":material/monitoring:", "pages/overview.py"),
    "compare": ("Compare", ":material/compare_arrows:", "pages/compare.py"),
    "traces": ("Traces", ":material/timeline:", "pages/traces.py"),
}
DEFAULT_PAGE = next(iter(PAGES))
#: The root URL's own page (hidden from the menu): it opens :data:`DEFAULT_PAGE` or ``?page=``.
ROOT_PATH = "home"


def _pages() -> dict:
    """``st.Page`` per :data:`PAGES` key, each at ``/<key>``, none the default.

    Streamlit serves its default page at ``/`` only (its ``url_path`` is
    ignored: ``/overview`` would answer "Page not found"), so the default
    page is a hidden one (:func:`_root`) that switches to the Overview; every
    listed page keeps its own URL."""
    return {key: st.Page(script, title=title, icon=icon, url_path=key) for key, (title, icon, script) in PAGES.items()}


def _target(pages: dict, at_root: bool):
    """The page to switch to before running ``nav``: ``?page=<name>`` (on
    any URL), else the Overview when at the root; None: run what was asked."""
    want = st.query_params.get("page")
    if want in pages:
        return pages[want]
    return pages[DEFAULT_PAGE] if at_root else None


def main() -> None:
    st.set_page_config(page_title="kvlens", page_icon=":material/swap_horiz:", layout="wide")
    cfg = parse_config()
    pages = _pages()
    root = st.Page(lambda: None, title="kvlens", url_path=ROOT_PATH, default=True, visibility="hidden")
    nav = st.navigation([root, *pages.values()], position="top")
    target = _target(pages, nav is root)
    if target is not None and nav is not target:
        st.switch_page(target, query_params={k: v for k, v in st.query_params.to_dict().items() if k != "page"})
    with st.sidebar:
        st.markdown("**kvlens** · KV handoff, push vs pull")
        st.caption(f"store: `{cfg.store}`")  # a URL's password is never shown
        st.caption(f"prometheus: `{cfg.prometheus or 'not set'}`")
    st.session_state[NAV_KEY] = True  # the pages check it (ui.run_page)
    nav.run()


if __name__ == "__main__":
    main()
