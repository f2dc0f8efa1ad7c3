"""What the sync and async clients share: run ids and handles, ``start``'s call, outcomes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stepd import _wire
from stepd._errors import run_error
from stepd.sansio.durations import Duration, parse_duration
from stepd.sansio.errors import Invalid

if TYPE_CHECKING:
    from stepd.embedded import Embedded
    from stepd.workflow import Workflow

__all__ = ["DEFAULT_RETRIES", "DEFAULT_TIMEOUT_S", "Handle"]

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_RETRIES = 3


class Handle:
    """What both run handles share: a run id that compares and prints as itself."""

    __slots__ = ("_client", "created", "run_id")

    def __init__(self, client: Any, run_id: str, created: bool) -> None:
        self._client = client
        self.run_id = run_id
        self.created = created

    def __str__(self) -> str:
        return self.run_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.run_id!r}, created={self.created})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Handle):
            return self.run_id == other.run_id
        if isinstance(other, str):
            return self.run_id == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.run_id)



def run_id_of(run: Handle | str) -> str:
    if isinstance(run, Handle):
        return run.run_id
    if isinstance(run, str) and run:
        return run
    raise Invalid(f"must be a run handle or a run id, got {run!r}", field="run")


def workflow_name(workflow: Workflow | str, version: str | None) -> tuple[str, str | None]:
    if isinstance(workflow, str):
        return workflow, version
    name = getattr(workflow, "name", None)
    if not isinstance(name, str):
        raise Invalid(f"must be a workflow name or a stepd.Workflow, got {workflow!r}",
                      field="workflow")
    return name, version if version is not None else workflow.version


def start_call(workflow: Workflow | str, input: Any, *, idempotency_key: str | None,
                correlation: Any, version: str | None, deadline: Duration | None) -> _wire.Call:
    name, version = workflow_name(workflow, version)
    deadline_ms = None if deadline is None else parse_duration(deadline, field="deadline")
    return _wire.start_run(name, input, version=version, correlation=correlation,
                           idempotency_key=idempotency_key, deadline_ms=deadline_ms)


def outcome(answer: dict[str, Any]) -> Any:
    """The result of a terminal ``result`` answer, or the typed error it stands for."""
    status = answer["status"]
    if status == "completed":
        return answer.get("result")
    raise run_error(answer["run_id"], status, answer.get("error"))


def embedded_of(target: Any) -> Embedded | None:
    from stepd.embedded import Embedded

    if isinstance(target, Embedded):
        return target
    return None
