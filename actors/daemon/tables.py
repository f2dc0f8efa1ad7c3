"""The daemon's LMDB tables: every name in one place (the storage opens them).

`stepd.storage` declares the built-in tables (``runs``, ``journal``,
``leases``, ...); `EXTRA_TABLES` are the ones this layer adds. The key and
value layouts are documented where they are written: `store` (runs,
journal, leases, timers, inbox, crashes) and `listing` (summaries and the
listing's indexes).
"""

from __future__ import annotations

from typing import Final

RUNS: Final = "runs"
JOURNAL: Final = "journal"
LEASES: Final = "leases"
DISPATCH_KEYS: Final = "dispatch_keys"
TIMERS: Final = "timers"
WORKERS: Final = "workers"

IDX_ACTIVE: Final = "idx_active"
INBOX: Final = "inbox"
RUN_CRASHES: Final = "run_crashes"
RUN_SUMMARIES: Final = "run_summaries"
IDX_RUNS_CREATED: Final = "idx_runs_created"
IDX_RUNS_STATUS: Final = "idx_runs_status"
IDX_RUNS_WORKFLOW: Final = "idx_runs_workflow"
IDX_RUNS_WF_STATUS: Final = "idx_runs_wf_status"
IDX_RUNS_CORRELATION: Final = "idx_runs_correlation"

EXTRA_TABLES: Final = (
    IDX_ACTIVE, INBOX, RUN_CRASHES, RUN_SUMMARIES, IDX_RUNS_CREATED, IDX_RUNS_STATUS,
    IDX_RUNS_WORKFLOW, IDX_RUNS_WF_STATUS, IDX_RUNS_CORRELATION,
)
