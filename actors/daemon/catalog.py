"""The definition catalog: every registered definition, by hash and by name.

Definitions are few and small, so the whole catalog lives in memory (loaded
from the `definitions` table at start) and lookups are pure dictionary reads:
that is what lets the run machine resolve a child workflow without I/O.

"Latest version" (WORKFLOWS.md: a run started without a version "picks the most
recently registered version of that name") is decided by *first* registration:
old and new workers re-registering on every reconnect during a rolling deploy
must not make the latest version flap back and forth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stepd.sansio.definition import Definition, parse_definition
from stepd.storage import ReadTxn, WriteTxn

from . import tables

TABLE = tables.DEFINITIONS
SEQ_KEY = b"definitions_seq"  # in tables.META


@dataclass(frozen=True, slots=True)
class Registered:
    definition: Definition
    order: int
    registered_at: int


class Catalog:
    def __init__(self) -> None:
        self._by_hash: dict[str, Registered] = {}
        self._by_name: dict[str, list[Registered]] = {}  # in registration order

    def __len__(self) -> int:
        return len(self._by_hash)

    def by_hash(self, definition_hash: str) -> Definition | None:
        reg = self._by_hash.get(definition_hash)
        return None if reg is None else reg.definition

    def resolve(self, name: str, version: str | None = None) -> Definition | None:
        """The definition a run of `name` (at `version`, if given) starts on."""
        regs = self._by_name.get(name)
        if not regs:
            return None
        for reg in reversed(regs):
            if version is None or reg.definition.version == version:
                return reg.definition
        return None

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def versions(self, name: str) -> list[Registered]:
        return list(self._by_name.get(name, ()))

    def add(self, reg: Registered) -> None:
        h = reg.definition.definition_hash
        if h in self._by_hash:
            return
        self._by_hash[h] = reg
        regs = self._by_name.setdefault(reg.definition.name, [])
        regs.append(reg)
        regs.sort(key=lambda r: r.order)

    def load_txn(self, txn: ReadTxn) -> None:
        for _, value in txn.scan(TABLE):
            assert isinstance(value, dict)
            definition = parse_definition(value["json"])
            self.add(Registered(definition, value["order"], value["registered_at"]))


def register_txn(txn: WriteTxn, definitions: list[Definition], now_ms: int) -> list[Registered]:
    """Store the definitions not stored yet; return their registrations.

    A definition already stored (same hash) keeps its first registration.
    """
    seq_raw = txn.get(tables.META, SEQ_KEY)
    seq = int(seq_raw) if isinstance(seq_raw, int) else 0
    added: list[Registered] = []
    for definition in definitions:
        h = definition.definition_hash
        if txn.exists(TABLE, h):
            continue
        seq += 1
        value: dict[str, Any] = {"json": definition.to_json(), "order": seq, "registered_at": now_ms}
        txn.put(TABLE, h, value)
        added.append(Registered(definition, seq, now_ms))
    if added:
        txn.put(tables.META, SEQ_KEY, seq)
    return added
