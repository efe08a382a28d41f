"""The front door the services share: what the router (``kvlens proxy``),
the collector (``kvlens collect``, HTTP and gRPC) and the dashboard put in
front of what they serve.

* :mod:`frontdoor.credentials`: the scoped credentials (``Security``, the
  roles), the one constant-time token check, "beyond loopback";
* :mod:`frontdoor.flags`: where credentials come from (``--token-file``,
  ``--<role>-token-file``, their variables, 16 characters at least; the API
  key's ``--api-key-file``) and the refusal to bind beyond loopback open;
* :mod:`frontdoor.bearer`: the one bearer-token middleware (ASGI), with what
  each service words differently as parameters (``exempt=``, ``body=``, ...);
* :mod:`frontdoor.backoff`: refused credentials slow a client down (the
  API's window, the dashboard sign-in's doubling wait);
* :mod:`frontdoor.samesite`: the Host / Origin / Content-Type guard against
  cross-site requests and DNS rebinding;
* :mod:`frontdoor.serving`: what kvlens' own uvicorn and gRPC servers share
  (TLS 1.2+ with kvlens' ciphers, client certificates, a connection cap).

It sits right above ``kvrecord`` (docs/architecture.md, "Layers"), so every
service can use it and none needs another's package for it. Nothing is
re-exported here: each name has one import path, its module's.
"""
