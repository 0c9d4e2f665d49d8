"""Who may call a server of ours: the bearer token read from the variable `--api-key-env` names, each
request's `Authorization` checked against it (401 without it), and the warning where a server listens
beyond this machine without one. The reward server (`servers.reward_server`) and the environment server
(`servers.env_server`) both use it. Standard library only: `rlhf serve-env` runs from any virtual
environment."""

from __future__ import annotations

import hmac
import os
import sys

from stages.common.hosts import LOOPBACK

UNAUTHORIZED = "a bearer token is required (Authorization: Bearer ...)"
"""A 401's reason, on every server."""
CHALLENGE = {"WWW-Authenticate": "Bearer"}
"""A 401's header: the scheme the server wants."""


def server_token(api_key_env: str | None, host: str, exposes: str, insecure: bool = False) -> str | None:
    """The bearer token every request must carry: the value of the variable `api_key_env` (`SystemExit`
    where it is unset), None without one. Without one, a server that listens on `host`, beyond this
    machine, is refused (`SystemExit`, `exposes`: what anyone who reaches its port could do) unless
    `insecure` (`--insecure`) says to serve anyway, then with a warning on stderr."""
    if api_key_env is not None:
        token = os.environ.get(api_key_env)
        if not token:
            raise SystemExit(f"--api-key-env {api_key_env}: the variable is not set")
        return token
    if host not in LOOPBACK:
        exposed = f"on {host} without a token: anyone who reaches this port can {exposes}"
        if not insecure:
            raise SystemExit(f"refusing to serve {exposed}; set --api-key-env VAR (a variable holding the token), "
                             "or pass --insecure to serve anyway")
        print(f"WARNING: serving {exposed}; set --api-key-env", file=sys.stderr, flush=True)
    return None


def authorized(token: str | None, header: str | None) -> bool:
    """Whether a request whose `Authorization` header is `header` may be served: any where the server has no
    token, else only `Bearer <token>` (compared in constant time)."""
    return token is None or hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())
