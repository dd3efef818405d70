"""Who may reach an engine: the address it listens on, and the run's API key, checked as SGLang 0.5.23 checks it.

Listening: an engine serves on one address, chosen by the orchestrator (127.0.0.1 when the
run fits one node, the recipe's ``cluster.network_interface`` otherwise); a wildcard address
(``0.0.0.0``, ``::``), which would accept connections on every interface, is refused
(:func:`check_listen_host`).

The key: every run draws one (:func:`new_api_key`); SGLang gets it as its ``--api-key`` (from a
file only the user can read, never on the command line), the reference server from the
environment (:data:`API_KEY_ENV`), and our client sends it on every request as
``Authorization: Bearer <key>``. :func:`is_authorized` is SGLang 0.5.23's decision
(``sglang/srt/utils/auth.py``, ``decide_request_auth``) for a server started with ``--api-key``
and no ``--admin-api-key``: ``OPTIONS`` and paths starting with ``/health``, ``/ready`` or
``/metrics`` pass without a key; every other path, unknown ones included, needs the header,
whose scheme is matched case-insensitively and whose token is compared in constant time. A
refused request gets 401 with the JSON body :data:`UNAUTHORIZED_BODY`, before the route (or
the body) is looked at. Engine process output is copied to its log with the key replaced by
:data:`REDACTED` (``ServerProcess``), since SGLang logs its server arguments, key included.
"""

from __future__ import annotations

import hmac
import secrets

API_KEY_ENV = "MEGATRON_RL_ENGINE_API_KEY"
"""Environment variable the reference server reads its key from; a run started with it set uses that key
(e.g. to reach the engines by hand while it runs) instead of drawing a new one."""
REDACTED = "<redacted>"
UNAUTHORIZED_STATUS = 401
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
"""SGLang's answer to a request without the right key: ``ORJSONResponse({"error": "Unauthorized"}, 401)``."""
OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")
"""Paths SGLang serves without a key (probes and Prometheus), matched by prefix as SGLang matches them."""
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "*", "[::]"})


def new_api_key() -> str:
    """A fresh random key for one run's engines (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def authorization_header(api_key: str) -> dict[str, str]:
    """The header our client sends with every request to an engine started with ``api_key``."""
    return {"Authorization": f"Bearer {api_key}"}


def is_authorized(method: str, path: str, authorization: str | None, api_key: str | None) -> bool:
    """Whether a server started with ``api_key`` (None: no key) lets the request through, as SGLang 0.5.23 does.

    ``path`` without the query string; ``authorization`` the ``Authorization`` header or None.
    """
    if api_key is None or method == "OPTIONS" or path.startswith(OPEN_PATH_PREFIXES):
        return True
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if not _ or scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), api_key.encode("utf-8"))


def check_listen_host(host: str) -> str:
    """``host`` when it names one address; ValueError for a wildcard that would listen on every interface."""
    if host.strip() in WILDCARD_HOSTS:
        raise ValueError(
            f"refusing to listen on {host!r} (every interface): an engine listens on 127.0.0.1 when the run fits one "
            "node, else on the address of cluster.network_interface"
        )
    return host
