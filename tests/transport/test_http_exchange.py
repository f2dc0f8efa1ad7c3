"""The HTTP worker path under stepd's own protocol (`stepd.transport._uvicorn.HttpExchange`)
and under a stock ASGI server (the ASGI messages, a watcher task per long-poll).

Both must answer alike: bodies whole or streamed (``Expect: 100-continue``),
pipelined requests in order, a long-poll abandoned by its client cancelled
(its slots back, counted as 499), head limits exact to the byte.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import InProcDaemon, serve_in_process, task_def, unique

MAX_HEAD = 2048


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcDaemon]:
    """`stepd serve` as it runs: stepd's HTTP protocol, small head limits."""
    yield from serve_in_process(tmp_path_factory.mktemp("own") / "data", max_request_ms=3000,
                                max_header_bytes=MAX_HEAD, max_headers=20)


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcDaemon]:
    """The daemon's app under uvicorn's own httptools protocol (as under any ASGI server):
    no `stepd.http` extension, so bodies, answers and disconnects go through ASGI."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    import stepd.daemon

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stepd.daemon, "http_protocol", lambda **limits: HttpToolsProtocol)
        yield from serve_in_process(Path(tmp_path_factory.mktemp("stock")) / "data",
                                    max_request_ms=3000)


@pytest.fixture(params=["own", "stock"])
def d(request: pytest.FixtureRequest) -> InProcDaemon:
    daemon: InProcDaemon = request.getfixturevalue(request.param)
    return daemon


def _addr(d: InProcDaemon) -> tuple[str, int]:
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _read_answers(sock: socket.socket, n: int, timeout: float = 5.0) -> list[tuple[int, bytes]]:
    """``n`` answers (status, body) read off a keep-alive connection (bounded)."""
    sock.settimeout(timeout)
    data = b""
    answers: list[tuple[int, bytes]] = []
    while len(answers) < n:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            head = data[:head_end].decode("latin-1")
            length = int(re.search(r"(?im)^content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
            if len(data) >= head_end + 4 + length:
                status = int(head.split(" ", 2)[1])
                answers.append((status, data[head_end + 4:head_end + 4 + length]))
                data = data[head_end + 4 + length:]
                continue
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"closed after {len(answers)} answers: {data[:300]!r}")
        data += chunk
    return answers


def _post(path: str, body: bytes, *, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n").encode() + body


def _register(d: InProcDaemon, name: str) -> str:
    with d.client() as http:
        r = http.post("/v1/api/workers/register", json={"definitions": [task_def(name, "a")]})
        worker_id: str = r.json()["worker_id"]
        return worker_id


def test_a_worker_round_answers_alike(d: InProcDaemon) -> None:
    """Register, start, claim (long-poll), complete: the same answers on either server."""
    name = unique()
    wid = _register(d, name)
    with d.client() as http:
        run_id = http.post("/v1/api/runs", json={"workflow": name, "input": 1}).json()["run_id"]
        claim = http.post("/v1/api/steps/claim", json={"worker_id": wid, "wait_ms": 2000})
        assert claim.status_code == 200 and claim.headers["content-type"] == "application/json"
        lease = claim.json()["leases"][0]
        done = http.post(f"/v1/api/steps/{lease['lease_id']}/complete",
                         json={"output": {"n": 1}, "started": True})
        assert (done.status_code, done.json()) == (200, {})
        again = http.post(f"/v1/api/steps/{lease['lease_id']}/complete", json={"output": 1})
        assert again.status_code == 409 and again.json()["reason"] == "already_applied"
        bad = http.post("/v1/api/steps/claim", json={"worker_id": wid, "max": True})
        assert bad.status_code == 400 and bad.json()["field"] == "max"
        assert http.get(f"/v1/api/runs/{run_id}").json()["status"] == "completed"


def test_pipelined_requests_are_answered_in_order(d: InProcDaemon) -> None:
    name = unique()
    wid = _register(d, name)
    claim = f'{{"worker_id": "{wid}", "wait_ms": 0}}'.encode()
    with socket.create_connection(_addr(d), timeout=5) as sock:
        sock.sendall(_post("/v1/api/steps/claim", claim) + _post("/v1/api/steps/claim", b"{}")
                     + _post("/v1/api/steps/l_nosuch/complete", b'{"output": 1}'))
        answers = _read_answers(sock, 3)
    assert [status for status, _ in answers] == [200, 400, 404], answers
    assert answers[0][1] == b'{"leases":[]}'
    assert b'"field":"worker_id"' in answers[1][1]


def test_a_body_sent_after_100_continue_is_read(d: InProcDaemon) -> None:
    """The body is not there with the head: it is read as it streams (ASGI ``receive``)."""
    name = unique()
    wid = _register(d, name)
    body = f'{{"worker_id": "{wid}", "wait_ms": 0}}'.encode()
    with socket.create_connection(_addr(d), timeout=5) as sock:
        head = _post("/v1/api/steps/claim", b"", extra="expect: 100-continue\r\n")
        sock.sendall(head.replace(b"content-length: 0", b"content-length: %d" % len(body)))
        sock.settimeout(5)
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body[:5])
        time.sleep(0.05)  # a body in two pieces
        sock.sendall(body[5:])
        [(status, answer)] = _read_answers(sock, 1)
    assert (status, answer) == (200, b'{"leases":[]}')


def test_an_abandoned_long_poll_returns_its_slots_and_counts_499(d: InProcDaemon) -> None:
    name = unique()
    wid = _register(d, name)
    engine = d.daemon.daemon
    body = f'{{"worker_id": "{wid}", "wait_ms": 10000}}'.encode()
    for _ in range(3):
        with socket.create_connection(_addr(d), timeout=5) as sock:
            sock.sendall(_post("/v1/api/steps/claim", body))
            deadline = time.monotonic() + 5
            while not d.run(engine.registry_stats).waiting_claims:
                assert time.monotonic() < deadline, "the claim never parked"
                time.sleep(0.01)
        deadline = time.monotonic() + 5
        while d.run(engine.registry_stats).waiting_claims:
            assert time.monotonic() < deadline, "the abandoned claim is still parked"
            time.sleep(0.01)
    with d.client() as http:
        run_id = http.post("/v1/api/runs", json={"workflow": name, "input": 1}).json()["run_id"]
        r = http.post("/v1/api/steps/claim", json={"worker_id": wid, "wait_ms": 2000})
        assert [x["run_id"] for x in r.json()["leases"]] == [run_id]
        deadline = time.monotonic() + 5
        while True:
            metrics = http.get("/metrics").text
            found = re.search(r'stepd_http_requests_total\{route="/v1/api/steps/claim",'
                              r'status="499"\} (\d+)', metrics)
            if found is not None and int(found.group(1)) >= 3:
                break
            assert time.monotonic() < deadline, "the abandoned claims were not counted as 499"
            time.sleep(0.01)


def _head_of(size: int, fields: int = 1) -> bytes:
    """A claim request whose request line and header names and values hold ``size`` bytes."""
    line = b"/v1/api/steps/claim"
    used = len(line) + len(b"host") + len(b"127.0.0.1") + len(b"content-length") + len(b"2")
    names = [b"x-f%d" % i for i in range(fields)]
    left = size - used - sum(len(n) for n in names)
    values = [b"v" * (left // fields + (1 if i < left % fields else 0)) for i in range(fields)]
    headers = b"".join(n + b": " + v + b"\r\n" for n, v in zip(names, values, strict=True))
    return b"POST " + line + b" HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 2\r\n" + \
        headers + b"\r\n{}"


@pytest.mark.parametrize("fields", [1, 5])
def test_the_head_limit_is_exact_to_the_byte(own: InProcDaemon, fields: int) -> None:
    """Counted once the head is complete: at the limit served (a 400 for the empty
    claim), one byte over refused with 431."""
    for size, expected in ((MAX_HEAD, 400), (MAX_HEAD + 1, 431)):
        with socket.create_connection(_addr(own), timeout=5) as sock:
            sock.sendall(_head_of(size, fields))
            [(status, _)] = _read_answers(sock, 1)
        assert status == expected, (size, fields)


def test_too_many_fields_and_a_split_head_are_refused(own: InProcDaemon) -> None:
    with socket.create_connection(_addr(own), timeout=5) as sock:
        sock.sendall(_head_of(400, fields=19))  # 21 fields with host and content-length
        [(status, _)] = _read_answers(sock, 1)
    assert status == 431
    # A head under the limit that arrives in pieces is served.
    with socket.create_connection(_addr(own), timeout=5) as sock:
        data = _head_of(MAX_HEAD, fields=3)
        for i in range(0, len(data), 300):
            sock.sendall(data[i:i + 300])
            time.sleep(0.01)
        [(status, _)] = _read_answers(sock, 1)
    assert status == 400
