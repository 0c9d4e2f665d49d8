"""Who may call our servers (`servers.auth`, the reward server's and the environment server's one rule):
a request without the token is refused with 401, a token variable that is unset stops the server, a
server listening beyond this machine without a token refuses to start unless `--insecure`, then warns;
and the environment server still imports nothing but the standard library (it runs from other virtual environments)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from servers.auth import CHALLENGE, UNAUTHORIZED, authorized, server_token
from servers.env_server import EpisodeServer, OursServed
from stages.common.hosts import LOOPBACK

REPO = Path(__file__).resolve().parent.parent
WARNING = ("WARNING: serving on 0.0.0.0 without a token: anyone who reaches this port can run episodes; "
           "set --api-key-env\n")


def test_a_request_is_served_only_with_the_servers_token():
    assert authorized(None, None) and authorized(None, "Bearer anything")  # no token: anyone
    assert authorized("s3cret", "Bearer s3cret")
    assert not authorized("s3cret", None) and not authorized("s3cret", "")
    assert not authorized("s3cret", "Bearer wrong") and not authorized("s3cret", "s3cret")
    assert not authorized("s3cret", "Bearer s3cret ") and not authorized("s3cret", "Bearer s3crét")


def test_a_server_beyond_this_machine_without_a_token_is_refused_unless_insecure(monkeypatch, capsys):
    with pytest.raises(SystemExit, match="refusing to serve on 0.0.0.0 without a token: anyone who reaches this "
                                         "port can run episodes; set --api-key-env VAR .*or pass --insecure"):
        server_token(None, "0.0.0.0", "run episodes")
    assert server_token(None, "0.0.0.0", "run episodes", insecure=True) is None
    assert capsys.readouterr().err == WARNING
    for host in sorted(LOOPBACK):
        assert server_token(None, host, "run episodes") is None
    monkeypatch.setenv("RLHF_TEST_SERVER_TOKEN", "s3cret")
    assert server_token("RLHF_TEST_SERVER_TOKEN", "0.0.0.0", "run episodes") == "s3cret"
    assert capsys.readouterr().err == ""  # on this machine, or with a token: nothing to warn of


def test_a_token_variable_that_is_not_set_stops_the_server(monkeypatch):
    monkeypatch.delenv("RLHF_TEST_SERVER_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="--api-key-env RLHF_TEST_SERVER_TOKEN: the variable is not set"):
        server_token("RLHF_TEST_SERVER_TOKEN", "127.0.0.1", "run episodes")
    monkeypatch.setenv("RLHF_TEST_SERVER_TOKEN", "")
    with pytest.raises(SystemExit, match="the variable is not set"):
        server_token("RLHF_TEST_SERVER_TOKEN", "127.0.0.1", "run episodes")


def test_the_environment_server_refuses_a_request_without_its_token_with_401():
    server = EpisodeServer(("127.0.0.1", 0), OursServed(None, "tests.helpers:served_faults", [], {}), "s3cret", 600.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        for refused in (httpx.get(url), httpx.post(url + "/reset", json={"row": {}}),
                        httpx.get(url, headers={"Authorization": "Bearer wrong"})):
            assert refused.status_code == 401 and refused.json() == {"error": UNAUTHORIZED}
            assert refused.headers["www-authenticate"] == CHALLENGE["WWW-Authenticate"]
        assert httpx.get(url, headers={"Authorization": "Bearer s3cret"}).json()["protocol"] == "rlhf-env/1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.multiprocess
def test_the_environment_server_imports_only_the_standard_library():
    """`rlhf serve-env --kind verifiers` runs it from .env-verifiers: nothing but the standard library (and
    our own modules it is made of) may load with it."""
    run = subprocess.run([sys.executable, "-S", "-c", "import servers.env_server"], capture_output=True, text=True,
                         cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)})  # -S: no site-packages at all
    assert run.returncode == 0, run.stderr[-2000:]
