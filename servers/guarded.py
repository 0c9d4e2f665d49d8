"""A standard-library HTTP server whose clients cannot hold more than it allows (`rlhf serve-env` is one).

What a client may hold is bounded (`Caps`):
- connections, each on a thread of its own: past `max_connections`, a new one is answered 503 and closed;
- time: a request must arrive whole (request line, headers and body) within `timeout_s` of the connection
  starting to wait for it, however slowly its bytes trickle in (a watchdog shuts the socket past it), so a
  slow or silent client, or a kept-alive connection left idle, lets its thread go; each read and write of
  the socket also times out after `timeout_s`;
- bodies: a `Content-Length` that is missing (411), not a plain non-negative integer or said twice
  differently (400), or past `max_body_bytes` (413) is refused before anything is read, and the connection
  closed; a chunked body is not read (501); a line or headers past the standard library's limits are
  refused by it (414, 431).

Every request is logged in one line on stderr: method, path (without its query), status and
milliseconds. `counters()` gives the requests served and those refused, by cause. Responses go out
with `TCP_NODELAY`: a response's headers and body are two small writes, and with Nagle's algorithm the
second waited for the client's delayed acknowledgement, 40 ms a request on loopback.
Standard library only, as `servers.env_server` (which runs in any virtual environment).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_BUSY_BODY = b'{"error": "too many connections; try again"}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))
"""The answer to a connection past `max_connections`, written whole before it is closed (no thread is started)."""


@dataclass(frozen=True, kw_only=True)
class Caps:
    """What the server's clients may hold at once, and for how long (module docstring)."""

    timeout_s: float = 30.0
    """Seconds a request may take to arrive whole, a kept-alive connection may idle, and a read or write may take."""
    max_connections: int = 256
    """Connections (each a thread) at once; past it, 503 and closed."""
    max_body_bytes: int = 8 * 2**20
    """A request body's bytes at most (413 past it)."""


class Refused(Exception):
    """A request the server will not serve: its HTTP status, the cause it is counted under and the reason."""

    def __init__(self, status: int, cause: str, reason: str):
        super().__init__(reason)
        self.status, self.cause = status, cause


class GuardedServer(ThreadingHTTPServer):
    """A `ThreadingHTTPServer` bounded by `Caps`: its live connections, each with the time by which the
    request it awaits must have arrived (None while one is being answered)."""

    daemon_threads = True
    block_on_close = False  # closing does not wait on a thread a client holds
    request_queue_size = 128
    """The listen backlog. socketserver's 5 dropped the SYN of a burst's sixth connection: it waited a second
    for its retry, before the server could accept or refuse it."""
    tick_s = 0.25
    """How often the watchdog looks at the connections' deadlines (and `tick` runs)."""

    def __init__(self, address: tuple[str, int], handler: type[GuardedHandler], caps: Caps,
                 log: Callable[[str], None] | None = None):
        super().__init__(address, handler)
        self.caps = caps
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.lock = threading.Lock()
        self.connections: dict[socket.socket, float | None] = {}
        self.late: set[socket.socket] = set()
        """Connections the watchdog shut (counted once, as "timeout")."""
        self.counts: Counter[str] = Counter()
        """Requests answered, refusals included ("requests"), and refused by cause ("refused:<cause>")."""
        self._closed = threading.Event()
        threading.Thread(target=self._watching, name="watchdog", daemon=True).start()

    def counters(self) -> dict:
        """Requests answered (refusals included), and those refused by cause."""
        with self.lock:
            refused = {key.split(":", 1)[1]: n for key, n in self.counts.items() if key.startswith("refused:")}
            return {"requests": self.counts["requests"], "refused": refused}

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def process_request(self, request: socket.socket, client_address) -> None:
        with self.lock:
            full = len(self.connections) >= self.caps.max_connections
            if not full:
                self.connections[request] = time.monotonic() + self.caps.timeout_s
        if full:
            self.count("refused:connections")
            try:
                request.settimeout(1.0)
                request.sendall(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def close_request(self, request: socket.socket) -> None:
        with self.lock:
            self.connections.pop(request, None)
            self.late.discard(request)
        super().close_request(request)

    def awaiting(self, request: socket.socket, waiting: bool) -> None:
        """The connection waits for a request (its deadline set) or has one whole (its deadline cleared)."""
        with self.lock:
            if request in self.connections:
                self.connections[request] = time.monotonic() + self.caps.timeout_s if waiting else None

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()

    def tick(self, now: float) -> None:
        """What a server does each watchdog tick besides the deadlines (`EpisodeServer` lets idle episodes go)."""

    def _watching(self) -> None:
        while not self._closed.wait(self.tick_s):
            now = time.monotonic()
            with self.lock:
                late = [c for c, deadline in self.connections.items() if deadline is not None and now > deadline]
                for connection in late:
                    self.connections[connection] = None  # shut once
                    self.late.add(connection)
            for connection in late:
                self.count("refused:timeout")
                try:
                    connection.shutdown(socket.SHUT_RDWR)  # the thread's blocked read returns; it closes the socket
                except OSError:
                    pass
            self.tick(now)

    def handle_error(self, request, client_address) -> None:
        """A connection that failed mid-answer (its client gone): one line, not a traceback."""
        error = sys.exc_info()[1]
        self.log(f"- - connection from {client_address[0]} failed: {type(error).__name__}: {error}")


class GuardedHandler(BaseHTTPRequestHandler):
    """A request of a `GuardedServer`: `body()` reads a POST's body within the caps; `refuse` answers a refusal."""

    server: GuardedServer
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # a garbled request line is answered with a status line, not as HTTP/0.9

    def setup(self) -> None:
        # Each read and write of the socket (StreamRequestHandler): a backstop for writes to a client that does not
        # read; a request's reads meet the watchdog's deadline first.
        self.timeout = self.server.caps.timeout_s + 1.0
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.started = time.monotonic()

    def handle_one_request(self) -> None:
        self.server.awaiting(self.connection, True)
        self.command, self.path = None, ""  # this request's, once its line is read
        super().handle_one_request()

    def parse_request(self) -> bool:
        self.started = time.monotonic()
        return super().parse_request()

    def body(self) -> bytes:
        """The request's body, whole; `Refused` (the connection then closed) for one the caps do not allow."""
        lengths = self.headers.get_all("Content-Length") or []
        if self.headers.get("Transfer-Encoding"):
            raise Refused(501, "body", "a chunked body is not read: send Content-Length")
        if not lengths:
            raise Refused(411, "body", "a POST needs Content-Length")
        if len(set(lengths)) > 1 or not (lengths[0].isascii() and lengths[0].isdigit()):
            raise Refused(400, "body", f"Content-Length {lengths[0] if len(lengths) == 1 else lengths}: not one "
                                       "non-negative integer")
        length = int(lengths[0])
        if length > self.server.caps.max_body_bytes:
            raise Refused(413, "body", f"a body of {length} bytes, over {self.server.caps.max_body_bytes}")
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            raise Refused(408, "timeout", f"the body did not arrive within {self.server.caps.timeout_s:g} s") from None
        if len(data) < length:
            raise Refused(400, "body", f"the body ended after {len(data)} of {length} bytes")
        self.server.awaiting(self.connection, False)
        return data

    def arrived(self) -> None:
        """A request with no body has arrived whole: what it asks may take longer than `timeout_s`."""
        self.server.awaiting(self.connection, False)

    def refuse(self, refused: Refused) -> None:
        """`refused` answered, counted by its cause (the watchdog counted a connection it shut); a refused body
        closes the connection (its bytes unread)."""
        if self.connection not in self.server.late:
            self.server.count(f"refused:{refused.cause}")
        if refused.cause in ("body", "timeout"):
            self.close_connection = True
        self.send_json(refused.status, {"error": str(refused)},
                       {"Connection": "close"} if self.close_connection else None)

    def send_json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals (a malformed request line, a line or headers too long, an unknown
        method): counted, answered in JSON, and the connection closed."""
        self.server.count("refused:malformed")
        self.close_connection = True
        self.send_json(code, {"error": message or self.responses.get(code, ("refused",))[0]}, {"Connection": "close"})

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self.server.count("requests")
        path = urlsplit(self.path or "").path[:200]
        printable = "".join(c if c.isprintable() else "?" for c in path) or "-"
        self.server.log(f"{self.command or '-'} {printable} {code} {(time.monotonic() - self.started) * 1000:.1f}ms")

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        self.server.log(f"- - {format % args}")
