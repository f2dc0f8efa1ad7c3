"""A ``complete`` with ``claim_next`` answers with the worker's next lease
(docs/leases.md "The next lease in the answer"), against a real daemon over HTTP.

Over HTTP long-poll a step used to cost two requests: the ``complete``, then the
claim that the run's next step answered (and the worker's next claim). With
``claim_next`` the step the completion makes runnable is offered in the same
commit to the worker that completed, and its lease comes back in the
``complete``'s answer, in the slot the completed lease frees: one request a step.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from .conftest import Worker, journal_types, start_run, task_def, unique, wait_result


def _connected(http: httpx.Client, worker_id: str) -> bool:
    """The worker's claim waits in its session (the workers API counts it connected)."""
    workers = http.get("/v1/api/workers").json()["workers"]
    return any(w["worker_id"] == worker_id and w["connected"] for w in workers)


def test_register_says_the_daemon_takes_claim_next(http: httpx.Client) -> None:
    r = http.post("/v1/api/workers/register", json={"definitions": [task_def(unique(), "a")]})
    assert r.status_code == 200 and r.json()["claim_next"] is True


def test_the_next_lease_comes_back_in_the_complete_not_the_waiting_claim(
        http: httpx.Client) -> None:
    name = unique()
    worker = Worker(http, [task_def(name, "a", "b")])
    run_id = start_run(http, name, input=1)
    first = worker.claim_one(run_id=run_id)
    assert first["step_id"] == "a"
    # A claim of the same worker waits meanwhile (as the SDK keeps one open for its
    # free slots): the next step must not go there, but to the complete's answer.
    waiting: list[Any] = []
    claim = threading.Thread(target=lambda: waiting.append(worker.claim(max=1, wait_ms=800)))
    claim.start()
    deadline = time.monotonic() + 10
    while not _connected(http, worker.worker_id) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _connected(http, worker.worker_id)

    r = worker.call(first["lease_id"], "complete", {"output": 2, "started": True,
                                                    "claim_next": True})
    assert r.status_code == 200, r.text
    leases = r.json()["leases"]
    assert [(x["run_id"], x["step_id"], x["attempt"]) for x in leases] == [(run_id, "b", 1)]
    assert leases[0]["steps"] == {"a": 2}  # what a claimed lease of that step holds
    claim.join(10)
    assert waiting == [[]]  # the waiting claim got nothing: its slots are still free

    # The lease is the worker's like any other: its calls apply, and the journal names it.
    last = worker.call(leases[0]["lease_id"], "complete", {"output": 3, "started": True,
                                                           "claim_next": True})
    assert last.status_code == 200 and "leases" not in last.json()  # nothing runnable after b
    assert wait_result(http, run_id)["result"] == 3
    events = http.get(f"/v1/api/runs/{run_id}/journal").json()["events"]
    assert any(e["type"] == "step_completed" and e.get("lease_id") == leases[0]["lease_id"]
               for e in events)
    held = [w for w in http.get("/v1/api/workers").json()["workers"]
            if w["worker_id"] == worker.worker_id]
    assert held and not held[0]["leases"]  # no lease left held in the worker's session


def test_a_fan_out_sends_one_lease_in_the_answer_and_the_rest_to_claims(
        http: httpx.Client) -> None:
    name = unique()
    definition = {"name": name, "steps": [
        {"id": "a", "kind": "task", "body": "a"},
        {"id": "f", "kind": "for_each", "body": "b", "items": "${steps.a}"},
    ]}
    worker = Worker(http, [definition])
    run_id = start_run(http, name)
    first = worker.claim_one(run_id=run_id)
    r = worker.call(first["lease_id"], "complete", {"output": [1, 2, 3], "started": True,
                                                    "claim_next": True})
    assert r.status_code == 200, r.text
    answered = r.json()["leases"]
    assert len(answered) == 1  # the one slot the completed lease frees
    rest: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while len(rest) < 2 and time.monotonic() < deadline:
        rest += worker.claim(max=5, wait_ms=500, run_id=run_id)
    items = sorted(x["item_index"] for x in [*answered, *rest])
    assert items == [0, 1, 2]
    for lease in [*answered, *rest]:
        out = worker.call(lease["lease_id"], "complete", {"output": lease["input"],
                                                          "started": True})
        assert out.status_code == 200, out.text
    assert wait_result(http, run_id)["result"] == [1, 2, 3]


def test_claim_next_must_be_a_boolean_and_nothing_is_applied(http: httpx.Client) -> None:
    name = unique()
    worker = Worker(http, [task_def(name, "a")])
    run_id = start_run(http, name)
    lease = worker.claim_one(run_id=run_id)["lease_id"]
    r = worker.call(lease, "complete", {"output": 1, "started": True, "claim_next": "yes"})
    assert r.status_code == 400
    assert r.json()["field"] == "claim_next"
    assert "step_completed" not in journal_types(http, run_id)
    ok = worker.call(lease, "complete", {"output": 1, "started": True})
    assert ok.status_code == 200 and ok.json() == {}
    assert wait_result(http, run_id)["result"] == 1
