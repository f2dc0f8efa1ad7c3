"""The daemon's LMDB tables: every name and key layout in one place.

`stepd.storage` opens the built-in tables (``runs``, ``journal``, ...);
`EXTRA_TABLES` are the ones this layer adds. Each name carries its key and
value layout as a comment; the transactions that write them are in `store`
(runs, journal, leases, timers, inbox, crashes), `listing` (the summaries
and the listing's indexes), `audit` and `catalog`.
"""

from __future__ import annotations

from typing import Final

# Built-in tables (stepd.storage opens them):
RUNS: Final = "runs"  # run id -> RunRecord.to_dict()
JOURNAL: Final = "journal"  # run id + u64be(seq) -> journal entry
LEASES: Final = "leases"  # lease id -> LeaseRecord.to_dict()
DEFINITIONS: Final = "definitions"  # definition hash -> {"json", "order", "registered_at"}
DISPATCH_KEYS: Final = "dispatch_keys"  # idempotency key -> {"run_id", "at"}
TIMERS: Final = "timers"  # u64be(due ms) + run id + tag -> {}: passivated runs' deadlines
AUDIT: Final = "audit"  # u64be(time ms) + u64be(seq) -> AuditEntry.to_dict()
WORKERS: Final = "workers"  # worker id -> registration
META: Final = "meta"  # b"schema_version", b"definitions_seq" -> int

# This layer's additions (`EXTRA_TABLES`):

IDX_ACTIVE: Final = "idx_active"  # run id -> 1: runs with work in flight
INBOX: Final = "inbox"  # target run id + NUL + source -> message for a maybe-passivated run
RUN_CRASHES: Final = "run_crashes"  # run id -> {"at": [ms, ...], "error"}
RUN_SUMMARIES: Final = "run_summaries"  # run id -> listing.summary(); indexes below: listing
IDX_RUNS_CREATED: Final = "idx_runs_created"
IDX_RUNS_STATUS: Final = "idx_runs_status"
IDX_RUNS_WORKFLOW: Final = "idx_runs_workflow"
IDX_RUNS_WF_STATUS: Final = "idx_runs_wf_status"
IDX_RUNS_CORRELATION: Final = "idx_runs_correlation"
WORK_SESSIONS: Final = "work_sessions"  # work session id -> WorkSessionRecord.to_dict()
IDX_WS_HOLDER: Final = "idx_ws_holder"  # worker id + NUL + session id -> 1: max_sessions slots in use
RUN_FORKS: Final = "run_forks"  # source run id + NUL + fork run id -> {"step_id", "at"}
SCHEDULES: Final = "schedules"  # schedule id -> schedule record (`schedule`: spec and cursor)

EXTRA_TABLES: Final = (
    IDX_ACTIVE, INBOX, RUN_CRASHES, RUN_SUMMARIES, IDX_RUNS_CREATED, IDX_RUNS_STATUS,
    IDX_RUNS_WORKFLOW, IDX_RUNS_WF_STATUS, IDX_RUNS_CORRELATION, WORK_SESSIONS, IDX_WS_HOLDER,
    RUN_FORKS, SCHEDULES,
)
