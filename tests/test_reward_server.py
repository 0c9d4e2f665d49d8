"""`rlhf serve-reward` under abuse (issue 77): a token, limits on what a request may hold, a bounded
queue, a per-request timeout, and a failing request that fails alone. The real server on the session's
reward checkpoint takes a flood, and requests schemathesis generates from its own OpenAPI schema; the
queue and the timeout are shown on the app with a slow scorer."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from servers.auth import UNAUTHORIZED
from servers.reward_server import Limits, reward_app
from tests.helpers import free_port, serve_process, served_in_thread, stop_process

TOKEN = "test-token-1234567890"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def guarded(trained):
    """`rlhf serve-reward` with a token and small limits: (base URL, its process)."""
    import sys

    port = free_port()
    os.environ["RLHF_TEST_REWARD_KEY"] = TOKEN
    process = serve_process([sys.executable, "-m", "flows.cli", "serve-reward", "--checkpoint", trained["reward"],
                      "--port", str(port), "--api-key-env", "RLHF_TEST_REWARD_KEY", "--max-rows", "16",
                      "--max-chars", "2000", "--max-body-mb", "1", "--max-queue", "64"])
    yield f"http://127.0.0.1:{port}", process
    stop_process(process)


def _peak_rss_mib(pid: int) -> float:
    status = open(f"/proc/{pid}/status").read()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def _request(kind: int, i: int) -> dict:
    """The flood's requests by kind: 0 good, 1 a body past 1 MiB, 2 too many rows, 3 a text too long,
    4 a message that is not {role, content}."""
    if kind == 0:
        rows = 1 + i % 4
        return {"prompts": [f"prompt {i} {r}" for r in range(rows)], "responses": [f"It is warm {i}."] * rows}
    if kind == 1:
        return {"prompts": ["p"], "responses": ["x" * (2**20 + 1000)]}
    if kind == 2:
        return {"prompts": ["p"] * 17, "responses": ["x"] * 17}
    if kind == 3:
        return {"prompts": ["p"], "responses": ["x" * 2001]}
    return {"prompts": [[{}]], "responses": ["x"]}


EXPECTED_STATUS = {0: 200, 1: 413, 2: 413, 3: 422, 4: 422}


@pytest.mark.multiprocess
def test_the_reward_server_wants_its_token_and_survives_a_flood_of_bad_requests(guarded, trained):
    from stages.rewards.scoring import RewardScorer

    base, process = guarded
    refused = httpx.post(base + "/score", json=_request(0, 0))
    assert refused.status_code == 401 and refused.json() == {"detail": UNAUTHORIZED}  # both servers' reason
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.post(base + "/score", json=_request(0, 0), headers=wrong).status_code == 401
    assert httpx.get(base + "/score").status_code == 401 and httpx.get(base + "/health").status_code == 200
    # the 40 MB response: refused by its Content-Length (read on and dropped, never held)
    huge = httpx.post(base + "/score", content=b'{"prompts": ["p"], "responses": ["' + b"x" * 40 * 2**20 + b'"]}',
                      headers=AUTH | {"content-type": "application/json"}, timeout=60)
    assert huge.status_code == 413 and "over the limit of 1048576 bytes" in huge.text
    assert process.poll() is None and httpx.get(base + "/health").status_code == 200
    before = _peak_rss_mib(process.pid)

    async def flood() -> list[tuple[int, int, httpx.Response]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=120, limits=limits) as client:
            async def one(i: int) -> tuple[int, int, httpx.Response]:
                kind = i % 5
                for _ in range(20):  # a full queue answers 503 with Retry-After: a polite client waits
                    answer = await client.post("/score", json=_request(kind, i))
                    if answer.status_code != 503:
                        break
                    await asyncio.sleep(float(answer.headers["retry-after"]))
                return kind, i, answer
            return await asyncio.gather(*(one(i) for i in range(300)))

    answers = asyncio.run(flood())
    statuses = [(kind, answer.status_code) for kind, _, answer in answers]
    assert all(status == EXPECTED_STATUS[kind] for kind, status in statuses), statuses
    assert process.poll() is None and httpx.get(base + "/health").json() == {"ok": True}  # still up
    scorer = RewardScorer.from_pretrained(trained["reward"])
    for kind, i, answer in answers:
        if kind == 0:
            request = _request(0, i)
            expected = scorer.score(request["prompts"], request["responses"])
            assert torch.allclose(torch.tensor(answer.json()["scores"]), expected, atol=1e-4)
    malformed = next(answer for kind, _, answer in answers if kind == 4)
    assert "role" in malformed.text and "content" in malformed.text
    too_long = next(answer for kind, _, answer in answers if kind == 3)
    assert "row 0: the response has 2001 characters, over the limit of 2000" in too_long.text
    counted = httpx.get(base + "/score", headers=AUTH).json()["requests"]  # every answer counted, by cause
    assert counted["answered"] >= len(answers) and counted["refused"]["unauthorized"] >= 3
    assert counted["refused"]["too_large"] >= 1 and counted["refused"]["invalid"] >= 2
    assert _peak_rss_mib(process.pid) - before < 200  # nothing past the limits was read into memory
    # an input longer than the model's positions is scored on its last ones, and says so
    long_text = {"prompts": ["p"], "responses": [" ".join(["warm"] * 390)]}
    cut = httpx.post(base + "/score", json=long_text, headers=AUTH, timeout=60)
    assert cut.status_code == 200 and cut.json()["truncated"] == [True]


class SlowScorer:
    """A stand-in for RewardScorer that takes `seconds` a pass and fails a response that says 'boom'."""

    def __init__(self, seconds: float):
        self.seconds, self.gain, self.bias, self.passes = seconds, 1.0, 0.0, 0
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))

    def encode(self, prompts, responses, complete):
        if any("boom" in r for r in responses):
            raise ValueError("this response cannot be scored")
        return [[1] * len(r) for r in responses]

    def raw_scores(self, sequences):
        self.passes += 1
        time.sleep(self.seconds)
        return torch.tensor([float(len(s)) for s in sequences])

    def normalize(self, raw):
        return raw


def _post_all(base: str, bodies: list[dict]) -> list[httpx.Response]:
    """The bodies posted at once, each on its own thread."""
    answers: list = [None] * len(bodies)

    def post(i: int) -> None:
        answers[i] = httpx.post(base + "/score", json=bodies[i], timeout=30)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
        time.sleep(0.02)  # in this order
    for thread in threads:
        thread.join()
    return answers


def test_a_full_queue_answers_503_a_slow_request_504_and_a_failing_one_fails_alone(capsys):
    scorer = SlowScorer(seconds=1.0)
    app = reward_app(scorer, {"checkpoint": "slow"}, max_batch=64, limits=Limits(max_queue=2, timeout_s=0.5))
    body = {"prompts": ["p"], "responses": ["abc"]}
    with served_in_thread(app) as base:
        answers = _post_all(base, [body] * 6)
        codes = sorted(a.status_code for a in answers)
        assert codes.count(504) >= 1 and codes.count(503) >= 1 and set(codes) <= {503, 504}, codes
        busy = next(a for a in answers if a.status_code == 503)
        assert busy.headers["retry-after"] == "1" and "--max-queue" in busy.text
        time.sleep(2.5)
        passes = scorer.passes
        assert passes <= 2  # requests abandoned at their timeout while queued are not scored
    scorer = SlowScorer(seconds=0.3)
    app = reward_app(scorer, {"checkpoint": "slow"}, limits=Limits(timeout_s=10))
    with served_in_thread(app) as base:
        answers = _post_all(base, [body, {"prompts": ["p"], "responses": ["boom"]}, body, body])
    assert [a.status_code for a in answers] == [200, 422, 200, 200]
    assert "this request cannot be scored: ValueError: this response cannot be scored" in answers[1].text
    logged = capsys.readouterr().err.splitlines()  # each request in one line: method, path, status, milliseconds
    assert sum(bool(re.fullmatch(r"POST /score 200 \d+\.\dms", line)) for line in logged) >= 3, logged[-10:]
    assert any(re.fullmatch(r"POST /score 50[34] \d+\.\dms", line) for line in logged), logged[-10:]
    assert [a.json()["scores"] for a in answers if a.status_code == 200] == [[3.0]] * 3


def test_the_reward_servers_schema_fuzzed_gets_no_server_error_and_answers_as_its_schema_says(guarded):
    """Every route of the real server (the session's reward checkpoint, its token) fed requests schemathesis
    generates from the server's own OpenAPI schema, valid and not: never a 5xx, a 200's body is what the
    schema describes, and the server runs on."""
    base, process = guarded
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/score", "/health"}
    fuzzed_with = set()
    for operation, mode in itertools.product(operations, GenerationMode):  # valid requests, and invalid ones
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzzed(case) -> None:
            response = case.call(headers=AUTH, timeout=60)
            case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
            fuzzed_with.add((case.operation.path, case.method, case.meta.generation.mode if case.meta else None))

        try:
            fuzzed()
        except Unsatisfiable:  # no invalid request exists for a route that takes nothing (GET /health)
            assert mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET"
    assert {("/score", "POST", GenerationMode.POSITIVE), ("/score", "POST", GenerationMode.NEGATIVE)} <= fuzzed_with
    assert process.poll() is None


def test_silent_and_slow_loris_connections_are_closed_and_the_server_answers_on(guarded):
    """Connections that never send a whole request head (silent, or a byte at a time) are closed within the
    keep-alive timeout (5 s), not held against the connection limit; the server answers a request after."""
    base, process = guarded
    port = int(base.rsplit(":", 1)[1])
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(80)]
    slow = socket.create_connection(("127.0.0.1", port), timeout=10)
    started = time.monotonic()
    head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for i in range(len(head)):  # a byte every 0.25 s: the head would take 16 s whole
        try:
            slow.sendall(head[i:i + 1])
        except OSError:
            break
        time.sleep(0.25)
    for connection in [*silent, slow]:
        assert connection.recv(65536) == b""  # closed by the server
        connection.close()
    assert time.monotonic() - started < 12
    assert httpx.get(base + "/health").status_code == 200 and process.poll() is None
