"""The dashboard gate's sign-in (issue 42, items 1 and 10), served by a real
uvicorn on loopback: after the form or a ``?token=`` link it goes back only
to a path on this site (every way a browser could be sent to another host:
tab, CR, LF, ``/%2f``, ``/\\``, ``//``), and wrong tokens from one address
are slowed (429 with a growing ``Retry-After``, nothing compared meanwhile),
per address, in bounded memory. The real ``kvlens dashboard`` and Chromium
check the redirect too (``tests/unit/test_dashboard_auth.py``,
``tests/e2e/test_e2e_dashboard_auth.py``)."""

from __future__ import annotations

import contextlib
import html
import re
import secrets
from typing import Iterator

import httpx
import pytest

from dashboard.gate import COOKIE, LOGIN_PATH, TokenGate, safe_next, session_value
from frontdoor.backoff import SignInBackoff
from test_dashboard_auth import _inner
from uvicorn_thread import serve

TOKEN = "dash-" + secrets.token_hex(16)
EVIL = "evil.example"
#: (the request target as sent, what the server decodes it to): each would
#: take a browser to another host if used as the redirect target
VARIANTS = [
    pytest.param(f"/%09/{EVIL}/", f"/\t/{EVIL}/", id="tab"),
    pytest.param(f"/%0d/{EVIL}/", f"/\r/{EVIL}/", id="cr"),
    pytest.param(f"/%0a/{EVIL}/", f"/\n/{EVIL}/", id="lf"),
    pytest.param(f"/%2f{EVIL}/", f"//{EVIL}/", id="pct2f"),
    pytest.param(f"/%5c{EVIL}/", f"/\\{EVIL}/", id="backslash"),
    pytest.param(f"//{EVIL}/", f"//{EVIL}/", id="double-slash"),
]


@contextlib.contextmanager
def served(gate: TokenGate) -> Iterator[str]:
    """``gate`` under a real uvicorn on a loopback port, in a thread."""
    with serve(gate, lifespan="off") as url:
        yield url


def _form_next(page: str) -> str:
    return html.unescape(re.search(r'name="next" value="([^"]*)"', page).group(1))


@pytest.mark.parametrize("sent, decoded", VARIANTS)
def test_sign_in_goes_back_only_to_a_path_on_this_site(sent, decoded):
    with served(TokenGate(_inner(), TOKEN.encode())) as url, httpx.Client(trust_env=False, timeout=10) as c:
        # the request the browser made first: the form's next is "/", not the other host
        r = c.get(url + sent, headers={"Accept": "text/html"})
        assert r.status_code == 401 and _form_next(r.text) == "/"
        # a form posted with that next anyway (by hand, by another page): back to "/"
        r = c.post(url + LOGIN_PATH, data={"token": TOKEN, "next": decoded}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/"
        c.cookies.clear()
        # the link with the token: the cookie, and "/" instead of the other host
        r = c.get(f"{url}{sent}?token={TOKEN}", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/"
        assert f"{COOKIE}={session_value(TOKEN.encode())}" in r.headers["set-cookie"]


def test_a_path_on_this_site_is_kept():
    with served(TokenGate(_inner(), TOKEN.encode())) as url, httpx.Client(trust_env=False, timeout=10) as c:
        r = c.get(url + "/compare?a=1&b=%2F%2Fx", headers={"Accept": "text/html"})
        assert r.status_code == 401 and _form_next(r.text) == "/compare?a=1&b=%2F%2Fx"
        r = c.post(url + LOGIN_PATH, data={"token": TOKEN, "next": "/compare?a=1"}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/compare?a=1"
        c.cookies.clear()
        r = c.get(f"{url}/traces?trace=ab&token={TOKEN}", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/traces?trace=ab"
        assert c.get(url + "/traces?trace=ab").text == "page /traces [('trace', 'ab')]"


@pytest.mark.parametrize(
    "target",
    ["/\t/x", "/\r\n/x", "/x\x00", "/x\x7f", "/x y", "//x", "///x", "/\\x", "http://x/", "https:/x", "x", "", None],
)
def test_safe_next_refuses_what_leaves_the_site(target):
    assert safe_next(target) == "/"


def test_wrong_tokens_get_429_growing_per_address_and_nothing_is_compared_meanwhile():
    now = [1000.0]
    backoff = SignInBackoff(free=5, first_s=2.0, max_s=8.0, clock=lambda: now[0])
    session = f"{COOKIE}={session_value(TOKEN.encode())}"
    with served(TokenGate(_inner(), TOKEN.encode(), backoff)) as url, httpx.Client(trust_env=False, timeout=10) as c:
        # five wrong tokens, one of each kind and more: 401 each
        assert c.get(f"{url}/?token=wrong1", follow_redirects=False).status_code == 401
        assert c.post(url + LOGIN_PATH, data={"token": "wrong2", "next": "/"}).status_code == 401
        assert c.get(url + "/", headers={"Authorization": "Bearer wrong3"}).status_code == 401
        assert c.get(f"{url}/?token=wrong4", follow_redirects=False).status_code == 401
        # no credential at all, or a stale cookie, is no guess: not counted
        assert c.get(url + "/").status_code == 401
        assert c.get(url + "/", headers={"Cookie": f"{COOKIE}={'0' * 64}"}).status_code == 401
        assert backoff.wait("127.0.0.1") == 0
        assert c.post(url + LOGIN_PATH, data={"token": "wrong5", "next": "/x"}).status_code == 401
        # now this address waits, and even the right token is not compared
        r = c.get(f"{url}/?token={TOKEN}", follow_redirects=False)
        assert r.status_code == 429 and r.headers["retry-after"] == "2" and "set-cookie" not in r.headers
        r = c.post(url + LOGIN_PATH, data={"token": TOKEN, "next": "/x"}, headers={"Accept": "text/html"})
        assert r.status_code == 429 and "try again in 2 s" in r.text and "set-cookie" not in r.headers
        r = c.get(url + "/", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        # a signed-in browser behind the same address still passes (a session is not guessable)
        assert c.get(url + "/x", headers={"Cookie": session}).text.startswith("page /x")
        # another address is not slowed
        with httpx.Client(
            transport=httpx.HTTPTransport(local_address="127.0.0.2"), trust_env=False, timeout=10
        ) as other:
            assert other.get(url + "/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        # after the wait, one more wrong token: a longer wait (4 s), then capped (8 s)
        now[0] += 2
        assert c.get(f"{url}/?token=wrong6", follow_redirects=False).status_code == 401
        assert c.get(f"{url}/?token={TOKEN}", follow_redirects=False).headers["retry-after"] == "4"
        now[0] += 4
        assert c.get(f"{url}/?token=wrong7", follow_redirects=False).status_code == 401
        now[0] += 8
        assert c.get(f"{url}/?token=wrong8", follow_redirects=False).status_code == 401
        assert c.get(f"{url}/?token={TOKEN}", follow_redirects=False).headers["retry-after"] == "8"
        # the right token once the wait is over: signed in, and the count forgotten
        now[0] += 8
        r = c.get(f"{url}/?token={TOKEN}", follow_redirects=False)
        assert r.status_code == 303 and "set-cookie" in r.headers
        assert backoff.wait("127.0.0.1") == 0 and len(backoff) == 0  # forgotten; 127.0.0.2 never failed


def test_the_backoff_remembers_a_bounded_number_of_addresses():
    now = [0.0]
    backoff = SignInBackoff(free=1, first_s=60.0, max_clients=3, clock=lambda: now[0])
    for i in range(10):
        backoff.failed(f"10.0.0.{i}")
    assert len(backoff) == 3
    assert backoff.wait("10.0.0.0") == 0 and backoff.wait("10.0.0.9") == 60.0
    # a client quiet for the forget time starts afresh
    now[0] += 10_000
    backoff.failed("10.0.0.9")
    assert backoff.wait("10.0.0.9") == 60.0  # free=1: the first failure of a fresh count waits first_s
