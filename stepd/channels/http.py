"""HTTP to a daemon URL: the worker's long-poll channel and the clients' HTTP backends.

* `HttpChannel` (the worker): ``POST /v1/api/steps/claim`` long-polls for up to
  the free slots; lease calls are plain requests. The fallback when the
  WebSocket is refused.
* `SyncHttp` (`stepd.Client`): httpx, one thread-safe connection pool.
* `AsyncHttp` (`stepd.AsyncClient`): `stepd._http1` for plain ``http://``
  URLs, httpx for ``https://`` or when a proxy from the environment applies.

Idempotent calls (`stepd._wire.Call.idempotent`) are retried on 503 and on
connection failures with jittered exponential backoff; a connection failure
is raised as `Unavailable` (its cause is the transport's error).
"""

from __future__ import annotations

import asyncio
import json
import json.encoder
import random
import time
from typing import Any, Protocol
from urllib.parse import quote

import anyio
import httpx

from stepd import _wire
from stepd._errors import Unavailable, error_from_answer
from stepd._http1 import Http1Client, Http1Error, Http1Response, wants_httpx
from stepd.actors import Waiter
from stepd.channels import Channel, Host, Lost, Unencodable
from stepd.sansio.errors import Invalid

__all__ = ["AsyncHttp", "HttpChannel", "SyncHttp", "base_url", "encode_body", "headers",
           "wants_httpx"]

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0

_JITTER = random.Random()
"""Our own generator: backoff jitter never touches the `random` module's global state
(which the application, or hypothesis in a test, may own)."""

_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _not_json(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_c_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODE = None if _c_make_encoder is None else _c_make_encoder(
    None, _not_json, getattr(json.encoder, "c_encode_basestring", None), None, ":", ",",
    False, False, False)
"""`_ENCODER` without its Python layers (one C call per body; no cycle check: a
body is a fresh tree of JSON values)."""

_DECODER = json.JSONDecoder()
_running_loop = asyncio._get_running_loop  # None outside asyncio (trio), without raising
_current_tasks: Any = getattr(asyncio.tasks, "_current_tasks", None)
# `asyncio.current_task()` is a Python function on 3.11; its dict answers in one C call.
_task_of = _current_tasks.get if isinstance(_current_tasks, dict) else asyncio.current_task


def _encode(body: Any) -> bytes:
    """`_ENCODER`'s JSON (compact, UTF-8, NaN refused), encoded.

    Raises:
        TypeError, ValueError: not JSON (a circular structure raises RecursionError's
            ValueError-free cousin: caught as not JSON by the callers too).
    """
    if not body and type(body) is dict:
        return b"{}"
    if _C_ENCODE is None:  # pragma: no cover - CPython ships the C encoder
        return _ENCODER.encode(body).encode()
    try:
        return "".join(_C_ENCODE(body, 0)).encode()
    except RecursionError:
        raise ValueError("a circular reference or a value nested too deeply") from None


_SCAN: Any = _DECODER.scan_once  # type: ignore[attr-defined]
"""The C scanner under `_DECODER.raw_decode` (one C call per answer, not three calls)."""


def _decode(content: bytes) -> Any:
    text = content.decode()
    try:
        value, end = _SCAN(text, 0)
    except StopIteration:
        return _DECODER.raw_decode(text)[0]  # raises the ValueError that says where
    if end != len(text) and text[end:].strip():
        raise ValueError("extra data after the JSON value")
    return value


def lease_path(op: str, lease_id: str) -> str:
    """``/v1/api/steps/{lease}/{op}`` (the id quoted only when it needs it)."""
    seg = lease_id if _wire.SAFE_ID.issuperset(lease_id) else quote(lease_id, safe="")
    return f"/v1/api/steps/{seg}/{op}"


def backoff(attempt: int) -> float:
    """The clients' jittered exponential backoff (bounded)."""
    return _JITTER.uniform(0.5, 1.0) * min(BACKOFF_CAP_S, BACKOFF_BASE_S * float(2 ** min(attempt, 16)))


def base_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise Invalid(f"must be an http:// or https:// URL, got {url!r}", field="url")
    return url.rstrip("/")


def headers(key: str | None) -> dict[str, str]:
    out = {"accept": "application/json", "user-agent": "stepd-python"}
    if key is not None:
        out["authorization"] = f"Bearer {key}"
    return out


def encode_body(body: Any) -> bytes:
    """JSON exactly as httpx encodes ``json=`` (UTF-8, compact, NaN refused)."""
    return _ENCODER.encode(body).encode("utf-8")


class _Response(Protocol):
    """What `answer_of` reads of an answer: an httpx.Response or a `Http1Response`."""

    @property
    def status_code(self) -> int: ...
    @property
    def content(self) -> bytes: ...
    @property
    def text(self) -> str: ...
    def json(self) -> Any: ...


def answer_of(response: _Response) -> dict[str, Any]:
    """The JSON answer of a 2xx, or the typed error of any other status."""
    try:
        body = response.json() if response.content else {}
    except ValueError:
        body = {"message": response.text[:500]}
    if response.status_code >= 300:
        raise error_from_answer(response.status_code, body)
    return body if isinstance(body, dict) else {"value": body}


# --------------------------------------------------------------------------- clients


class SyncHttp:
    """`stepd.Client`'s backend for a URL (httpx)."""

    def __init__(self, url: str, key: str | None, timeout: float, retries: int,
                 trust_env: bool) -> None:
        self.url = base_url(url)
        self.timeout = timeout
        self.retries = retries
        self.http = httpx.Client(base_url=self.url, headers=headers(key), timeout=timeout,
                                 trust_env=trust_env, http1=True, http2=False)

    def send(self, call: _wire.Call) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                response = self.http.request(
                    call.method, call.path, params=call.params() or None,
                    json=call.body if call.body is not _wire.NO_BODY else None,
                    timeout=self.timeout + call.hold_s,
                )
                return answer_of(response)
            except Unavailable:
                if not call.idempotent or attempt >= self.retries:
                    raise
            except httpx.TransportError as exc:
                if not call.idempotent or attempt >= self.retries:
                    raise Unavailable(f"cannot reach the daemon at {self.url}: {exc!r}") from exc
            time.sleep(backoff(attempt))
            attempt += 1

    def close(self) -> None:
        self.http.close()


class AsyncHttp:
    """`stepd.AsyncClient`'s backend for a URL: `stepd._http1` for plain http, httpx else."""

    def __init__(self, url: str, key: str | None, timeout: float, retries: int,
                 trust_env: bool) -> None:
        self.url = base_url(url)
        self.timeout = timeout
        self.retries = retries
        self.http: httpx.AsyncClient | None = None
        self.lean: Http1Client | None = None
        if wants_httpx(self.url, trust_env):
            self.http = httpx.AsyncClient(base_url=self.url, headers=headers(key),
                                          timeout=timeout, trust_env=trust_env, http1=True,
                                          http2=False)
        else:
            self.lean = Http1Client(self.url, headers(key))

    async def _request(self, call: _wire.Call) -> _Response:
        timeout = self.timeout + call.hold_s
        params = call.params() or None
        if self.lean is None:
            assert self.http is not None
            return await self.http.request(
                call.method, call.path, params=params,
                json=call.body if call.body is not _wire.NO_BODY else None, timeout=timeout)
        content = None if call.body is _wire.NO_BODY else encode_body(call.body)
        return await self.lean.request(call.method, call.path, params=params, content=content,
                                       timeout=timeout)

    async def send(self, call: _wire.Call) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                return answer_of(await self._request(call))
            except Unavailable:
                if not call.idempotent or attempt >= self.retries:
                    raise
            except (httpx.TransportError, Http1Error) as exc:
                if not call.idempotent or attempt >= self.retries:
                    raise Unavailable(f"cannot reach the daemon at {self.url}: {exc!r}") from exc
            await anyio.sleep(backoff(attempt))
            attempt += 1

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()
        if self.lean is not None:
            await self.lean.aclose()


def worker_http(url: str, key: str | None, timeout: float,
                trust_env: bool) -> httpx.AsyncClient | Http1Client:
    """The worker's HTTP client: the lean one for plain http, httpx for https and proxies."""
    if wants_httpx(url, trust_env):
        return httpx.AsyncClient(base_url=url, headers=headers(key), timeout=timeout,
                                 trust_env=trust_env, http1=True, http2=False)
    # No ``accept``: the daemon answers JSON whatever it says, and each header is a
    # parser callback on the daemon's side of every claim and lease call.
    return Http1Client(url, {k: v for k, v in headers(key).items() if k != "accept"})


# --------------------------------------------------------------------------- the worker


class HttpChannel(Channel):
    """HTTP long-poll: claims for the free slots, calls as plain requests."""

    kind = "http"

    def __init__(self, http: httpx.AsyncClient | Http1Client, timeout: float) -> None:
        self.http = http
        self.timeout = timeout
        self._claim_scope: anyio.CancelScope | None = None
        self._claim_task: _ClaimTask | None = None  # the claim in flight, on asyncio
        self._stopped = False
        self._ended = False
        self._wake: Waiter | None = None

    async def send(self, call: _wire.Call) -> dict[str, Any]:
        return await self._post(call.op, call.path, call.body, call.hold_s)

    async def _post(self, op: str, path: str, body: Any, hold_s: float = 0.0, *,
                    method: str = "POST") -> dict[str, Any]:
        try:
            content = _encode(body) if method == "POST" else b""
        except (TypeError, ValueError) as exc:
            raise Unencodable(str(exc)) from None
        response: httpx.Response | Http1Response
        try:
            http = self.http
            if isinstance(http, Http1Client):
                response = await http.request(method, path,
                                              content=content if method == "POST" else None,
                                              timeout=self.timeout + hold_s)
            elif method == "GET":
                response = await http.request("GET", path, timeout=self.timeout + hold_s)
            else:
                response = await http.request(
                    "POST", path, content=content, headers={"content-type": "application/json"},
                    timeout=self.timeout + hold_s)
        except (httpx.TransportError, Http1Error) as exc:
            raise Lost(f"HTTP {op}: {exc!r}") from None
        status = response.status_code
        content = response.content
        try:
            answer = _decode(content) if content else {}
        except ValueError:
            answer = {"message": response.text[:500]}
        if status >= 300:
            raise error_from_answer(status, answer)
        return answer if type(answer) is dict else {}

    async def register(self, body: dict[str, Any]) -> dict[str, Any]:
        answer = await self.send(_wire.register(body))
        # A daemon that does not say it takes `claim_next` would refuse the key (400).
        self.answers_leases = answer.get("claim_next") is True
        return answer

    async def call(self, op: str, lease_id: str, body: dict[str, Any]) -> dict[str, Any]:
        if op == "complete" and self.answers_leases and not (self._stopped or self._ended):
            # The run's next step comes back in this answer rather than in a claim's
            # (one request a step, not two): the slot this lease frees takes it.
            body = {**body, "claim_next": True}
        elif op == "history":  # the one GET among the lease calls
            return await self._post(op, lease_path(op, lease_id), None, method="GET")
        return await self._post(op, lease_path(op, lease_id), body)

    async def session_call(self, op: str, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        verb = op.removeprefix("session_")
        return await self._post(op, f"/v1/api/sessions/{session_id}/{verb}", body)

    async def pump(self, host: Host, max_request_ms: int) -> None:
        assert host.worker_id is not None
        wait_ms = max(1, max_request_ms)
        while not host.stopping and not self._stopped and not self._ended:
            free = host.concurrency - host.running
            if free <= 0:
                await self._wait()
                continue
            leases: list[dict[str, Any]] = []
            loop = _running_loop()
            if loop is not None:
                leases = await self._claim_on_asyncio(loop, host, free, wait_ms)
            else:
                with anyio.CancelScope() as scope:
                    self._claim_scope = scope
                    if host.stopping or self._stopped:
                        scope.cancel()
                    try:
                        answer = await self.send(_wire.claim(host.worker_id, free, wait_ms))
                        leases = answer.get("leases") or []
                    except Unavailable:
                        raise Lost("the daemon answered 503 to a claim") from None
                self._claim_scope = None
            for lease in leases:
                host.accept(lease)
        while not self._ended:
            await self._wait()

    async def _claim_on_asyncio(self, loop: asyncio.AbstractEventLoop, host: Host,
                                free: int, wait_ms: int) -> list[dict[str, Any]]:
        """One claim, cut short by `stop_taking`/`end` through the pump's task rather
        than a cancel scope (~30 calls a claim: a first step over HTTP reaches its
        worker through one). The cancel is ours alone to swallow: withdrawn with
        ``uncancel``, and swallowed only when no other cancel of the task (its task
        group's) is pending, as `asyncio.timeout` does."""
        task = _task_of(loop)
        assert task is not None
        claim = self._claim_task = _ClaimTask(task)
        try:
            if host.stopping or self._stopped:
                return []
            assert host.worker_id is not None
            try:
                answer = await self.send(_wire.claim(host.worker_id, free, wait_ms))
            except Unavailable:
                raise Lost("the daemon answered 503 to a claim") from None
            except asyncio.CancelledError:
                if claim.requested:
                    claim.requested = False  # withdrawn here: `finally` has nothing to do
                    if task.uncancel() == 0:
                        return []
                raise
            leases: list[dict[str, Any]] = answer.get("leases") or []
            return leases
        finally:
            self._claim_task = None
            if claim.requested:
                # Asked after the answer was in (the cancel was not delivered, or it
                # was and something else is pending): withdraw ours.
                task.uncancel()

    async def _wait(self) -> None:
        wake = self._wake = Waiter()
        await wake.wait()

    def _poke(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.set()

    def slots_changed(self) -> None:
        self._poke()

    def stop_taking(self) -> None:
        # A claim cancelled now returns the slots the daemon had not offered yet.
        # (An answer already on its way is lost with the request: the daemon
        # recovers those attempts when their leases expire; docs/sdk.md.)
        self._stopped = True
        self._cancel_claim()
        self._poke()

    def end(self) -> None:
        self._ended = True
        self._cancel_claim()
        self._poke()

    def _cancel_claim(self) -> None:
        if self._claim_scope is not None:
            self._claim_scope.cancel()
        claim = self._claim_task
        if claim is not None and not claim.requested:
            claim.requested = True
            claim.task.cancel()


class _ClaimTask:
    """The pump's task while it claims on asyncio, and whether a cancel was asked of it."""

    __slots__ = ("requested", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.requested = False
