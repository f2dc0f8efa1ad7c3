"""Keys, scopes and the fallback table (PROTOCOL.md "Authentication and scopes").

The matrix tests check every scope's key against every `Need`, for every
combination of configured scopes, against an oracle written from the spec's
table; the literal tables below pin the common configurations by hand, so the
oracle and the code cannot share a misreading unnoticed.
"""

from __future__ import annotations

import hmac
import itertools
import pickle
from typing import Any

import pytest

from stepd.sansio.errors import Invalid, StepdError
from stepd.transport.auth import (
    Forbidden,
    KeyRing,
    Need,
    Principal,
    Scope,
    Unauthorized,
    check_bind_address,
    is_loopback_host,
    key_id,
)

KEYS = {scope: f"key-{scope.value}-S3cr3tValue0123456789" for scope in Scope}


def ring(*scopes: Scope) -> KeyRing:
    """A keyring with one key (`KEYS[scope]`) for each scope given."""
    return KeyRing.from_config(**{s.value: [KEYS[s]] for s in scopes})


def bearer(raw: str) -> str:
    return f"Bearer {raw}"


def allowed(kr: KeyRing, scope: Scope, need: Need) -> bool:
    try:
        kr.authorize(bearer(KEYS[scope]), need)
    except Forbidden:
        return False
    return True


def oracle(configured: frozenset[Scope], key_scope: Scope, need: Need) -> bool:
    """PROTOCOL.md's table, read as docs/http-api.md states it."""
    if key_scope is Scope.ADMIN:
        return True  # "An admin key has every scope."
    if need is Need.ADMIN:
        return False  # "audit log, actors, kill: admin, no fallback"
    own = {Need.WORKER: Scope.WORKER, Need.EXECUTE: Scope.EXECUTE, Need.READ: Scope.READ}[need]
    if own in configured:
        return key_scope is own
    if need is Need.READ:
        return key_scope in (Scope.WRITE, Scope.EXECUTE)  # "write, then execute"
    return key_scope is Scope.WRITE


ALL_CONFIGS = [
    frozenset(c) for n in range(1, len(Scope) + 1) for c in itertools.combinations(Scope, n)
]


@pytest.mark.parametrize(
    "configured", ALL_CONFIGS, ids=lambda c: "+".join(sorted(s.value for s in c))
)
def test_matrix_every_configuration(configured: frozenset[Scope]) -> None:
    kr = ring(*configured)
    for key_scope in configured:
        for need in Need:
            expected = oracle(configured, key_scope, need)
            assert allowed(kr, key_scope, need) is expected, (key_scope, need)
            assert (key_scope in kr.accepted_scopes(need)) is expected


# (key scope, need) -> allowed, every scope configured: no fallback applies.
ALL_CONFIGURED = {
    (Scope.ADMIN, Need.WORKER): True, (Scope.ADMIN, Need.EXECUTE): True,
    (Scope.ADMIN, Need.READ): True, (Scope.ADMIN, Need.ADMIN): True,
    (Scope.WRITE, Need.WORKER): False, (Scope.WRITE, Need.EXECUTE): False,
    (Scope.WRITE, Need.READ): False, (Scope.WRITE, Need.ADMIN): False,
    (Scope.WORKER, Need.WORKER): True, (Scope.WORKER, Need.EXECUTE): False,
    (Scope.WORKER, Need.READ): False, (Scope.WORKER, Need.ADMIN): False,
    (Scope.EXECUTE, Need.WORKER): False, (Scope.EXECUTE, Need.EXECUTE): True,
    (Scope.EXECUTE, Need.READ): False, (Scope.EXECUTE, Need.ADMIN): False,
    (Scope.READ, Need.WORKER): False, (Scope.READ, Need.EXECUTE): False,
    (Scope.READ, Need.READ): True, (Scope.READ, Need.ADMIN): False,
}  # fmt: skip

# Only write (and admin) keys: write does every non-admin call.
WRITE_ONLY = {
    (Scope.WRITE, Need.WORKER): True, (Scope.WRITE, Need.EXECUTE): True,
    (Scope.WRITE, Need.READ): True, (Scope.WRITE, Need.ADMIN): False,
}  # fmt: skip

# write + execute, no read, no worker key: workers use write keys; both write
# and execute keys read (the case the two readings of "write, then execute"
# disagree on; see docs/http-api.md).
WRITE_EXECUTE = {
    (Scope.WRITE, Need.WORKER): True, (Scope.WRITE, Need.EXECUTE): False,
    (Scope.WRITE, Need.READ): True, (Scope.WRITE, Need.ADMIN): False,
    (Scope.EXECUTE, Need.WORKER): False, (Scope.EXECUTE, Need.EXECUTE): True,
    (Scope.EXECUTE, Need.READ): True, (Scope.EXECUTE, Need.ADMIN): False,
}  # fmt: skip

# worker + execute, nothing else: execute keys read (no read, no write key).
WORKER_EXECUTE = {
    (Scope.WORKER, Need.WORKER): True, (Scope.WORKER, Need.EXECUTE): False,
    (Scope.WORKER, Need.READ): False, (Scope.WORKER, Need.ADMIN): False,
    (Scope.EXECUTE, Need.WORKER): False, (Scope.EXECUTE, Need.EXECUTE): True,
    (Scope.EXECUTE, Need.READ): True, (Scope.EXECUTE, Need.ADMIN): False,
}  # fmt: skip

# read configured: write and execute keys no longer read.
WRITE_EXECUTE_READ = {
    (Scope.WRITE, Need.READ): False, (Scope.EXECUTE, Need.READ): False,
    (Scope.READ, Need.READ): True, (Scope.WRITE, Need.WORKER): True,
    (Scope.WRITE, Need.EXECUTE): False, (Scope.READ, Need.EXECUTE): False,
}  # fmt: skip


@pytest.mark.parametrize(
    ("scopes", "table"),
    [
        (tuple(Scope), ALL_CONFIGURED),
        ((Scope.WRITE, Scope.ADMIN), WRITE_ONLY),
        ((Scope.WRITE, Scope.EXECUTE), WRITE_EXECUTE),
        ((Scope.WORKER, Scope.EXECUTE), WORKER_EXECUTE),
        ((Scope.WRITE, Scope.EXECUTE, Scope.READ), WRITE_EXECUTE_READ),
    ],
    ids=["all", "write+admin", "write+execute", "worker+execute", "write+execute+read"],
)
def test_literal_tables(scopes: tuple[Scope, ...], table: dict[tuple[Scope, Need], bool]) -> None:
    kr = ring(*scopes)
    for (key_scope, need), expected in table.items():
        assert allowed(kr, key_scope, need) is expected, (key_scope, need)


def test_forbidden_is_403_and_names_the_accepted_scopes_not_the_key() -> None:
    kr = ring(Scope.WORKER, Scope.EXECUTE)
    with pytest.raises(Forbidden) as info:
        kr.authorize(bearer(KEYS[Scope.WORKER]), Need.EXECUTE)
    exc = info.value
    assert exc.status == 403
    assert isinstance(exc, StepdError)
    assert exc.reason == "insufficient_scope"
    assert exc.need is Need.EXECUTE
    assert exc.key_id == key_id(KEYS[Scope.WORKER])
    assert "execute" in exc.message
    assert KEYS[Scope.WORKER] not in str(exc) + repr(exc)


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, "missing"),
        ("", "missing"),
        ("   ", "missing"),
        ("Bearer", "malformed"),
        ("Bearer ", "malformed"),
        ("Basic " + KEYS[Scope.ADMIN], "malformed"),
        ("Token " + KEYS[Scope.ADMIN], "malformed"),
        (KEYS[Scope.ADMIN], "malformed"),  # no scheme
        ("Bearer " + KEYS[Scope.ADMIN] + " extra", "malformed"),
        ("Bearer\t" + KEYS[Scope.ADMIN], "malformed"),
        ("Bearer k\u00e9y", "malformed"),
        ("Bearer garbage-that-nobody-configured", "unknown_key"),
        ("Bearer " + KEYS[Scope.ADMIN][:-1], "unknown_key"),
        ("Bearer " + KEYS[Scope.ADMIN].upper(), "unknown_key"),  # keys are case-sensitive
    ],
)
def test_401(header: str | None, reason: str) -> None:
    kr = ring(*Scope)
    for need in Need:
        with pytest.raises(Unauthorized) as info:
            kr.authorize(header, need)
        assert info.value.status == 401
        assert info.value.reason == reason
        assert isinstance(info.value, StepdError)
        assert "Bearer" in info.value.www_authenticate
        shown = str(info.value) + repr(info.value)
        assert not any(raw in shown for raw in KEYS.values())


def test_unknown_key_401_carries_its_id_never_the_key() -> None:
    kr = ring(Scope.READ)
    with pytest.raises(Unauthorized) as info:
        kr.authorize("Bearer not-a-configured-key", Need.READ)
    assert info.value.key_id == key_id("not-a-configured-key")
    assert 'error="invalid_token"' in info.value.www_authenticate


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_scheme_is_case_insensitive(scheme: str) -> None:
    kr = ring(Scope.READ)
    principal = kr.authorize(f"{scheme} {KEYS[Scope.READ]}", Need.READ)
    assert principal.key_id == key_id(KEYS[Scope.READ])


def test_surrounding_and_repeated_spaces_are_tolerated() -> None:
    kr = ring(Scope.READ)
    assert kr.authorize(f"  Bearer   {KEYS[Scope.READ]}  ", Need.READ).scope is Scope.READ


def test_admin_allows_everything_and_holds_every_scope() -> None:
    for configured in ALL_CONFIGS:
        if Scope.ADMIN not in configured:
            continue
        kr = ring(*configured)
        for need in Need:
            p = kr.authorize(bearer(KEYS[Scope.ADMIN]), need)
            assert p.scopes == frozenset(Scope)


def test_principal_records_the_scope_used() -> None:
    kr = ring(Scope.WRITE, Scope.EXECUTE)
    assert kr.authorize(bearer(KEYS[Scope.WRITE]), Need.WORKER).scope is Scope.WRITE
    assert kr.authorize(bearer(KEYS[Scope.EXECUTE]), Need.READ).scope is Scope.EXECUTE
    assert kr.authorize(bearer(KEYS[Scope.WRITE]), Need.READ).scope is Scope.WRITE
    assert kr.authorize(bearer(KEYS[Scope.EXECUTE]), Need.EXECUTE).scope is Scope.EXECUTE
    admin = ring(Scope.ADMIN, Scope.READ)
    assert admin.authorize(bearer(KEYS[Scope.ADMIN]), Need.READ).scope is Scope.ADMIN


def test_one_key_under_several_scopes_gets_all_of_them() -> None:
    shared = "shared-key-0123456789abcdef"
    kr = KeyRing.from_config(worker=[shared], execute=[shared, "other-exec-key"], read=["r-key-1"])
    p_work = kr.authorize(bearer(shared), Need.WORKER)
    p_exec = kr.authorize(bearer(shared), Need.EXECUTE)
    assert p_work.scope is Scope.WORKER and p_exec.scope is Scope.EXECUTE
    assert p_work.scopes == frozenset({Scope.WORKER, Scope.EXECUTE})
    with pytest.raises(Forbidden):
        kr.authorize(bearer(shared), Need.READ)  # a read key exists; shared is not one
    # Used as the most specific scope first: a key that is worker and admin is
    # recorded as worker on a worker call.
    both = KeyRing.from_config(worker=[shared], admin=[shared])
    assert both.authorize(bearer(shared), Need.WORKER).scope is Scope.WORKER
    assert both.authorize(bearer(shared), Need.ADMIN).scope is Scope.ADMIN


def test_several_keys_per_scope() -> None:
    kr = KeyRing.from_config(
        read=["read-one-xxxxxxxx", "read-two-xxxxxxxx"], admin=["adm-xxxxxxxxxx"]
    )
    for raw in ("read-one-xxxxxxxx", "read-two-xxxxxxxx"):
        assert kr.authorize(bearer(raw), Need.READ).key_id == key_id(raw)
    assert len(kr.key_ids()) == 3


def test_anonymous_when_no_key_is_configured() -> None:
    kr = KeyRing.from_config()
    assert not kr.enabled
    assert repr(kr) == "KeyRing(no keys: auth disabled)"
    for need in Need:
        for header in (None, "Bearer whatever", "garbage"):
            p = kr.authorize(header, need)
            assert p.anonymous and p.key_id is None
            assert p.scopes == frozenset(Scope)
        assert kr.accepted_scopes(need) == frozenset(Scope)
    assert kr.authorize(None, Need.READ).scope is Scope.READ


def test_enabled_with_any_single_key() -> None:
    for scope in Scope:
        kr = ring(scope)
        assert kr.enabled
        assert kr.configured_scopes() == {scope}
        with pytest.raises(Unauthorized):
            kr.authorize(None, Need.READ)


def test_compares_against_every_digest_without_early_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)  # auth calls hmac.compare_digest
    kr = ring(*Scope)
    # The first configured key (admin), the last (read), those between, an
    # unknown key and a refused one: every digest is compared every time.
    for scope in Scope:
        calls.clear()
        try:
            kr.authorize(bearer(KEYS[scope]), Need.READ)
        except Forbidden:
            pass
        assert len(calls) == len(Scope), scope
    calls.clear()
    with pytest.raises(Unauthorized):
        kr.authorize("Bearer unknown-key-zzzzzzzz", Need.READ)
    assert len(calls) == len(Scope)
    # What is compared is digests, never the raw key.
    assert all(len(a) == len(b) == 32 for a, b in calls)


# --------------------------------------------------------------------------- key hygiene


def _all_text(obj: Any, depth: int = 0) -> str:
    """Every string, bytes (as text and hex) and repr reachable from ``obj``."""
    if depth > 6:
        return ""
    parts = [repr(obj)]
    if isinstance(obj, bytes):
        parts += [obj.hex(), obj.decode("latin-1")]
    elif isinstance(obj, dict):
        for k, v in obj.items():
            parts += [_all_text(k, depth + 1), _all_text(v, depth + 1)]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        parts += [_all_text(v, depth + 1) for v in obj]
    elif hasattr(obj, "__dict__"):
        parts.append(_all_text(vars(obj), depth + 1))
    return "\n".join(parts)


def test_keyring_never_holds_a_raw_key() -> None:
    raws = {scope: f"RAW-{scope.value}-{'q' * 24}" for scope in Scope}
    kr = KeyRing.from_config(**{s.value: [raws[s]] for s in Scope})
    dumped = _all_text(kr) + repr(kr) + str(kr) + pickle.dumps(kr).decode("latin-1")
    for raw in raws.values():
        assert raw not in dumped
        assert raw.encode().hex() not in dumped
    assert "RAW-" not in dumped
    assert repr(kr) == "KeyRing(admin=1, write=1, worker=1, execute=1, read=1)"
    # The ids are shown instead, and they are not the key.
    assert set(kr.key_ids()) == {key_id(r) for r in raws.values()}


def test_principal_and_errors_never_hold_a_raw_key() -> None:
    raw = "RAW-principal-key-" + "z" * 20
    kr = KeyRing.from_config(read=[raw], execute=["exec-key-" + "y" * 20])
    p = kr.authorize(bearer(raw), Need.READ)
    assert raw not in _all_text(p)
    with pytest.raises(Forbidden) as info:
        kr.authorize(bearer(raw), Need.EXECUTE)
    assert raw not in _all_text(info.value) + str(info.value)


def test_key_id() -> None:
    kid = key_id("abc")
    assert kid == "ba7816bf8f01"  # SHA-256("abc") starts ba7816bf8f01cfea...
    assert len(kid) == 12 and kid == kid.lower()
    assert key_id("abd") != kid


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"read": [""]}, "keys.read[0]"),
        ({"write": ["ok-key-xxxxxxxx", "has space"]}, "keys.write[1]"),
        ({"admin": ["tab\tkey"]}, "keys.admin[0]"),
        ({"worker": ["new\nline"]}, "keys.worker[0]"),
        ({"execute": ["n\u00f6n-ascii"]}, "keys.execute[0]"),
        ({"read": [42]}, "keys.read[0]"),
        ({"read": "a-single-string-key"}, "keys.read"),
    ],
)
def test_bad_keys_are_refused_naming_the_field_not_the_key(
    config: dict[str, Any], field: str
) -> None:
    with pytest.raises(Invalid) as info:
        KeyRing.from_config(**config)
    assert info.value.field == field
    for value in config.values():
        for raw in value if isinstance(value, list) else [value]:
            if isinstance(raw, str) and len(raw) > 3:
                assert raw not in info.value.message


# --------------------------------------------------------------------------- bind address


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.0.0.53",
        "127.255.255.254",
        "::1",
        "[::1]",
        "localhost",
        "LOCALHOST",
        "::ffff:127.0.0.1",
        "0:0:0:0:0:0:0:1",
    ],
)
def test_loopback_hosts(host: str) -> None:
    assert is_loopback_host(host)
    check_bind_address(host, KeyRing.from_config())  # no keys: allowed


@pytest.mark.parametrize(
    "host",
    [
        "0.0.0.0",
        "::",
        "[::]",
        "",
        "192.168.1.10",
        "10.0.0.1",
        "::ffff:10.0.0.1",
        "example.com",
        "localhost.example.com",
        "128.0.0.1",
        "fe80::1",
    ],
)
def test_non_loopback_hosts_refused_without_keys(host: str) -> None:
    assert not is_loopback_host(host)
    with pytest.raises(Invalid) as info:
        check_bind_address(host, KeyRing.from_config())
    assert info.value.field == "listen"
    assert "without API keys" in info.value.message


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "127.0.0.1"])
def test_any_host_allowed_with_keys(host: str) -> None:
    check_bind_address(host, ring(Scope.READ))


def test_principal_is_frozen() -> None:
    p = Principal("abc", frozenset({Scope.READ}), Scope.READ)
    with pytest.raises(AttributeError):
        p.key_id = "x"  # type: ignore[misc]


# --------------------------------------------------------------------------- the docs


def test_docs_worked_examples_match_the_code() -> None:
    """docs/http-api.md's "Worked examples" table is what the keyring does."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text()
    section = text.split("Worked examples:", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    assert len(rows) >= 5
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0] == "all five":
            configured = frozenset(Scope)
        else:
            configured = frozenset(Scope(c.strip("` ")) for c in cells[0].split(","))
        kr = ring(*configured)
        for need, cell in zip(
            (Need.WORKER, Need.EXECUTE, Need.READ, Need.ADMIN), cells[1:], strict=True
        ):
            expected = (
                set()
                if not cell or cell.startswith("(")
                else {Scope(c.strip()) for c in cell.split(",")}
            )
            assert kr.accepted_scopes(need) & configured == expected, (row, need)
