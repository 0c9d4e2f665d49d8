"""The hosts a request to which never leaves this machine: where a client's token may travel in plain http
(`stages.common.clients.exposed_token`) and a server may listen without one (`servers.auth`). Standard
library only: `rlhf serve-env` imports it from any virtual environment."""

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
"""Hosts a request to which never leaves this machine."""
