"""The environment server (`rlhf serve-env`, `servers.guarded`) under a raw-socket fuzzer: lying, negative and
missing lengths, slow-loris, silent connections, garbage and huge headers. None of it crashes the server or
grows it without bound: its threads stay under its connection cap plus a few, its memory under 64 MiB more
than before, every abusive connection is closed within its timeout, and a well-behaved episode is served
after it all. Each refusal is counted by its cause in `GET /` and each request logged in one line. The
agent programs' endpoint (aiohttp, verifiers' bridge runs on one too) takes the same abuse."""

from __future__ import annotations

import random
import re
import socket
import threading
import time

import httpx
import pytest

from rlhf.sections.environment import EnvironmentServerConfig
from servers.env_server import EpisodeCaps, EpisodeServer, OursServed
from servers.guarded import Caps
from stages.envs.agent import AgentEndpoint
from stages.envs.parsers import AssistantTurn, ToolCall
from stages.envs.remote.served import EnvironmentServer, ServedEpisode

ROW = {"messages": [{"role": "user", "content": "Describe the cat."}]}
CAPS = Caps(timeout_s=1.0, max_connections=16)
THREADS_OVER_CAP = 4
"""Threads the server may run beyond one per connection: its watchdog, the serving loop and slack."""
RSS_GROWTH_BYTES = 64 * 2**20


@pytest.fixture()
def server():
    served = OursServed(None, "tests.helpers:served_faults", [], {})
    server = EpisodeServer(("127.0.0.1", 0), served, None, 600.0, CAPS,
                           EpisodeCaps(max_episodes=40, max_client_episodes=20))
    server.lines = []
    server.log = server.lines.append
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _connect(server) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
    return connection


def _exchange(server, raw: bytes) -> bytes:
    """`raw` sent on a fresh connection; everything the server answers until it closes the connection."""
    with _connect(server) as connection:
        connection.sendall(raw)
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _post(path: str, length: str | None, body: bytes = b"", extra: str = "") -> bytes:
    header = "" if length is None else f"Content-Length: {length}\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{header}{extra}Connection: close\r\n\r\n".encode() + body


def _rss() -> int:
    status = open("/proc/self/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def _threads_settle(limit: int, within_s: float) -> int:
    deadline = time.monotonic() + within_s
    while threading.active_count() > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    return threading.active_count()


def test_lengths_that_lie_or_are_malformed_are_refused_before_the_body_is_read(server):
    base_threads = threading.active_count()
    assert _status(_exchange(server, _post("/reset", "-1", b'{"row": {}}'))) == 400
    assert _status(_exchange(server, _post("/reset", "+5", b'{"row"'))) == 400
    assert _status(_exchange(server, _post("/reset", "0x10", b"{}"))) == 400
    assert _status(_exchange(server, _post("/reset", None, b'{"row": {}}'))) == 411
    assert _status(_exchange(server, _post("/reset", "2", b"{}", "Content-Length: 3\r\n"))) == 400
    assert _status(_exchange(server, _post("/reset", None, b"5\r\n{}{}{\r\n0\r\n\r\n",
                                           "Transfer-Encoding: chunked\r\n"))) == 501
    started, rss = time.monotonic(), _rss()
    huge = _exchange(server, _post("/reset", str(40 * 2**20), b"x" * 65536))  # says 40 MiB: never read
    assert _status(huge) == 413 and time.monotonic() - started < 1.0 and _rss() - rss < RSS_GROWTH_BYTES
    # a body shorter than it says: the connection waits for the rest, then is answered 408 and closed
    started = time.monotonic()
    late = _exchange(server, _post("/reset", "100", b'{"row"'))
    assert late == b"" or _status(late) == 408  # the socket's timeout, or the watchdog's shut
    assert CAPS.timeout_s * 0.9 <= time.monotonic() - started < CAPS.timeout_s + 1.0
    # a body longer than it says: the rest is read as the next request, an unknown method's
    answer = _exchange(server, b"POST /close HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}GARBAGE / HTTP/1.1\r\n\r\n")
    assert [int(s) for s in re.findall(rb"HTTP/1.1 (\d+)", answer)] == [200, 501]
    counts = httpx.get(f"http://127.0.0.1:{server.server_port}/").json()["refused"]
    assert counts == {"body": 7, "timeout": 1, "malformed": 1}
    assert _threads_settle(base_threads, 5.0) <= base_threads


def test_slow_and_silent_connections_hold_no_more_than_the_cap_and_go_at_the_timeout(server):
    base_threads, rss = threading.active_count(), _rss()
    silent = [_connect(server) for _ in range(300)]  # 300 connections, not one byte sent
    slow = [_connect(server) for _ in range(8)]
    for connection in slow:
        connection.settimeout(0.01)
    trickled = b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n"
    peak, started = 0, time.monotonic()
    for i in range(len(trickled)):  # slow-loris: a byte a connection every 0.1 s, 5 s for the whole request
        for connection in slow:
            try:
                connection.send(trickled[i:i + 1])
            except OSError:
                pass
        peak = max(peak, threading.active_count())
        time.sleep(0.1)
        if time.monotonic() - started > CAPS.timeout_s * 3:
            break
    assert peak <= base_threads + CAPS.max_connections + THREADS_OVER_CAP
    assert _rss() - rss < RSS_GROWTH_BYTES
    assert _threads_settle(base_threads, 5.0) <= base_threads
    for connection in silent + slow:  # every one was closed by the server: answered 503, or at its timeout
        connection.settimeout(5)
        answer = connection.recv(65536)
        assert answer == b"" or _status(answer) == 503
        connection.close()
    info = httpx.get(f"http://127.0.0.1:{server.server_port}/").json()
    assert info["refused"]["connections"] + info["refused"]["timeout"] == 308
    assert info["refused"]["timeout"] >= CAPS.max_connections
    assert _works(server)


def test_garbage_and_huge_headers_are_answered_400_or_431_and_the_server_serves_on(server):
    rng = random.Random(0)
    base_threads = threading.active_count()
    for _ in range(200):
        garbage = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000)))
        answer = _exchange(server, garbage + b"\r\n\r\n")
        assert answer == b"" or _status(answer) in (400, 404, 405, 414, 431, 501, 505), answer[:200]
    assert _status(_exchange(server, b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n")) == 414
    assert _status(_exchange(server, b"GET / HTTP/1.1\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n")) == 431
    many = "".join(f"X-{i}: y\r\n" for i in range(150))
    assert _status(_exchange(server, f"GET / HTTP/1.1\r\n{many}\r\n".encode())) == 431
    assert _status(_exchange(server, _post("/reset", "8", b"\xff\xfe{[(\x00\x80\x81"))) == 400  # not JSON
    assert _status(_exchange(server, _post("/reset", "2000", b"[" * 1000 + b"]" * 1000))) == 400  # nested deep
    assert _threads_settle(base_threads, 5.0) <= base_threads
    assert _works(server)


def test_episodes_are_capped_for_one_client_and_in_all(server):
    client = EnvironmentServer(EnvironmentServerConfig(url=f"http://127.0.0.1:{server.server_port}", max_retries=0))
    for _ in range(20):
        client.request("POST", "/reset", {"row": ROW})
    refused = httpx.post(f"http://127.0.0.1:{server.server_port}/reset", json={"row": ROW})
    assert refused.status_code == 429 and "the most for one client (--max-client-episodes)" in refused.text
    server.episode_caps = EpisodeCaps(max_episodes=20, max_client_episodes=100)
    refused = httpx.post(f"http://127.0.0.1:{server.server_port}/reset", json={"row": ROW})
    assert refused.status_code == 503 and "its most (--max-episodes)" in refused.text
    info = httpx.get(f"http://127.0.0.1:{server.server_port}/").json()
    assert info["episodes"] == 20 and info["started"] == 20
    assert info["refused"] == {"client_episodes": 1, "episodes": 1}


def test_each_request_is_logged_in_one_line_and_counted(server):
    assert _works(server)
    httpx.get(f"http://127.0.0.1:{server.server_port}/nowhere?token=secret")
    lines = list(server.lines)
    assert any(re.fullmatch(r"POST /reset 200 \d+\.\dms", line) for line in lines), lines
    assert any(re.fullmatch(r"POST /step 200 \d+\.\dms", line) for line in lines), lines
    assert any(re.fullmatch(r"GET /nowhere 404 \d+\.\dms", line) for line in lines), lines  # never the query
    assert not any("secret" in line for line in lines)
    info = httpx.get(f"http://127.0.0.1:{server.server_port}/").json()
    assert info["requests"] == len([line for line in lines if not line.startswith("- -")])
    assert info["started"] == 1 and info["failed"] == 0


def _works(server) -> bool:
    """A well-behaved episode, a reset, a tool call's step and a close, on the server."""
    client = EnvironmentServer(EnvironmentServerConfig(url=f"http://127.0.0.1:{server.server_port}"))
    episode = ServedEpisode(client)
    try:
        call = AssistantTurn(text='<tool_call>{"name":"f"}</tool_call>', content="", calls=[ToolCall("f", {})])
        return episode.reset(ROW) == ROW["messages"] and bool(episode.step(call).messages)
    finally:
        episode.close()
        client.close()


class QuickEndpoint(AgentEndpoint):
    IDLE_S = 1.0


def test_the_agent_endpoint_refuses_malformed_requests_and_closes_silent_connections():
    """The policy's endpoint for agent programs (and verifiers' bridge): garbage, a negative length and a
    huge header are 400, no token 401 before any body is read; 100 silent connections and a slow-loris are
    closed once idle past `IDLE_S`, and the endpoint answers on."""
    endpoint = QuickEndpoint(keep_alive=True)
    try:
        port = int(endpoint.url.rsplit(":", 1)[1])
        route = "/episodes/none/v1/chat/completions"
        target = type("Target", (), {"server_port": port})()
        assert _status(_exchange(target, b"\x00\xffgarbage\r\n\r\n")) == 400
        assert _status(_exchange(target, _post(route, "-1", b"{}"))) == 400
        assert _status(_exchange(target, b"GET / HTTP/1.1\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n")) == 400
        with _connect(target) as lying:  # the token first: answered before the body it says is coming
            lying.sendall(_post(route, "100", b"{}"))
            assert _status(lying.recv(65536)) == 401
        rss = _rss()
        silent = [_connect(target) for _ in range(100)]
        slow = _connect(target)
        slow.sendall(b"POST " + route.encode() + b" HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        started = time.monotonic()
        for connection in [*silent, slow]:
            connection.settimeout(QuickEndpoint.IDLE_S + 5)
            assert connection.recv(65536) in (b"",) or b"408" in connection.recv(65536)
            connection.close()
        assert time.monotonic() - started < QuickEndpoint.IDLE_S + 5 and _rss() - rss < RSS_GROWTH_BYTES
        answer = httpx.post(endpoint.url + route, json={"messages": []},
                            headers={"Authorization": f"Bearer {endpoint.token}"})
        assert answer.status_code == 404  # served on: no such episode
    finally:
        endpoint.close()
