"""API keys, scopes and the authorization decision (PROTOCOL.md "Authentication and scopes").

Every call carries ``Authorization: Bearer <key>``. Keys are configured on the
daemon per scope (`Scope`); each call group needs one thing (`Need`), and the
`KeyRing` decides, for a presented key and a need, whether the call may go on.

The fallback table, as implemented (docs/http-api.md "Authentication" has the
same table and the reasoning):

==========  =====================================  ======================================
need        accepted when its own keys exist        accepted when none of its own keys exist
==========  =====================================  ======================================
WORKER      ``worker``                              ``write``
EXECUTE     ``execute``                             ``write``
READ        ``read``                                ``write`` and ``execute``
ADMIN       ``admin``                               (nothing else)
==========  =====================================  ======================================

and an ``admin`` key is accepted for every need. "Its own keys exist" means at
least one key is configured for that scope, whoever holds it. The fallback is
decided once, from the configuration, not per key.

Security properties this module keeps, because the anchors ask for them
(research/anchors-reliability.md section 7.1 and test Z1):

* Only SHA-256 digests of keys are held; the raw key is dropped as soon as it
  is hashed. `key_id` (12 hex of the digest) is what logs and the audit log see.
* A presented key is compared with `hmac.compare_digest` against *every*
  configured digest, without stopping at a match, and the scopes of the match
  are folded in without a data-dependent branch, so the time taken does not
  say which entry (or which scope) matched.

Errors: `Unauthorized` (401: no key, a malformed header, an unknown key) and
`Forbidden` (403: a known key without the scope), both `StepdError`s with a
``status`` and a short ``reason`` for the audit log. A daemon without any key
serves without auth, only on a loopback address: `check_bind_address`.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Final

from stepd.sansio.enums import IdentityEnum
from stepd.sansio.errors import Invalid, StepdError

__all__ = [
    "ANONYMOUS_KEY_ID",
    "Forbidden",
    "KeyRing",
    "Need",
    "Principal",
    "Scope",
    "Unauthorized",
    "check_bind_address",
    "is_loopback_host",
    "key_id",
]


class Scope(IdentityEnum):
    """A scope keys are configured under (PROTOCOL.md "Authentication and scopes")."""

    ADMIN = "admin"
    WRITE = "write"
    WORKER = "worker"
    EXECUTE = "execute"
    READ = "read"


class Need(IdentityEnum):
    """What a call group requires.

    ``WORKER``: the worker calls (register, claim, started/heartbeat/complete/fail,
    the worker WebSocket). ``EXECUTE``: start, signal, cancel. ``READ``: run
    status, lists, journals, exports, results, the workers list. ``ADMIN``: the
    audit log, the actor tree, kill.
    """

    WORKER = "worker"
    EXECUTE = "execute"
    READ = "read"
    ADMIN = "admin"


_BIT: Final[Mapping[Scope, int]] = {scope: 1 << i for i, scope in enumerate(Scope)}
_ALL_BITS: Final = sum(_BIT.values())

#: Each need's own scope: the one its calls require before any fallback.
_PRIMARY: Final[Mapping[Need, Scope]] = {
    Need.WORKER: Scope.WORKER,
    Need.EXECUTE: Scope.EXECUTE,
    Need.READ: Scope.READ,
    Need.ADMIN: Scope.ADMIN,
}

ANONYMOUS_KEY_ID: Final = None
"""The `Principal.key_id` when auth is disabled (no key configured): no key, no id."""

_KEY_ID_HEX: Final = 12


def _digest(raw: str) -> bytes:
    return hashlib.sha256(raw.encode("utf-8")).digest()


def key_id(raw: str) -> str:
    """The short, non-secret id of a key: the first 12 hex digits of its SHA-256.

    What logs, the audit log and error messages show instead of the key. 48 bits
    tell keys apart in practice and reveal nothing usable about a random key
    (keys should be ``secrets.token_urlsafe(32)``, 256 bits).

    Args:
        raw: the key as configured or presented.

    Returns:
        12 lowercase hex digits.
    """
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:_KEY_ID_HEX]


def _bits_to_scopes(bits: int) -> frozenset[Scope]:
    return frozenset(scope for scope, bit in _BIT.items() if bits & bit)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling, as handlers and the audit log see it (never the key).

    Attributes:
        key_id: `key_id` of the key, or None when auth is disabled.
        scopes: every scope the key holds (all of them for ``admin`` keys and
            for the anonymous principal).
        scope: the scope that granted this call (the audit log's "scope").
    """

    key_id: str | None
    scopes: frozenset[Scope]
    scope: Scope

    @property
    def anonymous(self) -> bool:
        """True when the daemon runs without keys (loopback only)."""
        return self.key_id is None


_ALL_SCOPES: Final = frozenset(Scope)

#: With auth disabled every call gets the anonymous principal of its need:
#: built once (it is immutable), not per call.
_ANONYMOUS: Final[Mapping[Need, Principal]] = {
    need: Principal(ANONYMOUS_KEY_ID, _ALL_SCOPES, scope) for need, scope in _PRIMARY.items()
}


class _AuthError(StepdError):
    """Base of the two refusals; not raised itself."""

    status: ClassVar[int]

    def __init__(self, message: str, *, reason: str, key_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.key_id = key_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, reason={self.reason!r})"


class Unauthorized(_AuthError):
    """401: no key, a malformed ``Authorization`` header, or a key nobody configured.

    Attributes:
        status: 401.
        reason: ``missing``, ``malformed`` or ``unknown_key`` (for logs and the
            audit log; the HTTP answer says no more than "unauthorized").
        key_id: `key_id` of the presented key when one could be read (an
            unknown key), else None. Never the key.
        www_authenticate: the ``WWW-Authenticate`` header value for the answer
            (RFC 6750 section 3).
    """

    status: ClassVar[int] = 401

    @property
    def www_authenticate(self) -> str:
        if self.reason == "missing":
            return 'Bearer realm="stepd"'
        error = "invalid_request" if self.reason == "malformed" else "invalid_token"
        return f'Bearer realm="stepd", error="{error}"'


class Forbidden(_AuthError):
    """403: a known key without the scope the call needs.

    Attributes:
        status: 403.
        reason: ``insufficient_scope``.
        key_id: `key_id` of the key.
        need: what the call needed.
    """

    status: ClassVar[int] = 403

    def __init__(self, message: str, *, key_id: str, need: Need) -> None:
        super().__init__(message, reason="insufficient_scope", key_id=key_id)
        self.need = need


class KeyRing:
    """The configured keys, as digests, and the authorization decision.

    Build it with `from_config`. The raw keys are hashed on the way in and kept
    nowhere (not in attributes, not in ``repr``). One entry per distinct key,
    holding every scope that key was configured under.
    """

    def __init__(self, entries: Mapping[bytes, int], configured: int) -> None:
        """Use `from_config`; this takes digests already.

        Args:
            entries: SHA-256 digest of each distinct key -> bitmask of its scopes.
            configured: bitmask of the scopes that have at least one key.
        """
        self._entries: tuple[tuple[bytes, int], ...] = tuple(entries.items())
        self._ids: tuple[str, ...] = tuple(d.hex()[:_KEY_ID_HEX] for d, _ in self._entries)
        self._configured = configured
        self._accepts: dict[Need, int] = {need: self._accepted_bits(need) for need in Need}

    @classmethod
    def from_config(
        cls,
        *,
        admin: Iterable[str] = (),
        write: Iterable[str] = (),
        worker: Iterable[str] = (),
        execute: Iterable[str] = (),
        read: Iterable[str] = (),
    ) -> KeyRing:
        """Build a keyring from keys per scope.

        A scope may have several keys (rotation: add the new key, move clients,
        remove the old one). The same key given under several scopes holds all
        of them.

        Args:
            admin, write, worker, execute, read: the keys of each scope.

        Returns:
            The keyring; `enabled` is False when every list is empty.

        Raises:
            Invalid: a key is not a string, is empty, or holds a character a
                Bearer token cannot carry (whitespace, control characters,
                non-ASCII); ``field`` names it (``keys.read[1]``) and the
                message never repeats the key.
        """
        entries: dict[bytes, int] = {}
        configured = 0
        for scope, keys in (
            (Scope.ADMIN, admin),
            (Scope.WRITE, write),
            (Scope.WORKER, worker),
            (Scope.EXECUTE, execute),
            (Scope.READ, read),
        ):
            if isinstance(keys, str):
                raise Invalid("must be a list of keys, not one string", field=f"keys.{scope.value}")
            for position, raw in enumerate(keys):
                _check_key(raw, f"keys.{scope.value}[{position}]")
                digest = _digest(raw)
                entries[digest] = entries.get(digest, 0) | _BIT[scope]
                configured |= _BIT[scope]
        return cls(entries, configured)

    # -- queries ------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether any key is configured; without keys the daemon serves without auth."""
        return bool(self._entries)

    def configured_scopes(self) -> frozenset[Scope]:
        """The scopes that have at least one key."""
        return _bits_to_scopes(self._configured)

    def accepted_scopes(self, need: Need) -> frozenset[Scope]:
        """The scopes whose keys this keyring accepts for ``need`` (the fallback applied).

        With auth disabled, every scope (any call is allowed).
        """
        if not self.enabled:
            return _ALL_SCOPES
        return _bits_to_scopes(self._accepts[need])

    def _accepted_bits(self, need: Need) -> int:
        own = _PRIMARY[need]
        bits = _BIT[Scope.ADMIN]
        if need is Need.ADMIN:
            return bits
        if self._configured & _BIT[own]:
            return bits | _BIT[own]
        if need is Need.READ:
            # "read: falls back to write, then execute": with no read key
            # configured, write keys and execute keys both read.
            return bits | _BIT[Scope.WRITE] | _BIT[Scope.EXECUTE]
        return bits | _BIT[Scope.WRITE]

    # -- the decision -------------------------------------------------------

    def authorize(self, authorization: str | None, need: Need) -> Principal:
        """Decide whether a call with this ``Authorization`` header may do ``need``.

        Args:
            authorization: the header's value, or None when absent.
            need: what the call group requires.

        Returns:
            The `Principal`; with auth disabled, an anonymous one holding every
            scope (the header is then ignored).

        Raises:
            Unauthorized: no header, a header that is not ``Bearer <key>``
                (scheme case-insensitive), or a key that is not configured.
            Forbidden: a configured key whose scopes do not grant ``need``.
        """
        if not self._entries:
            return _ANONYMOUS[need]
        raw = _bearer_token(authorization)
        presented = _digest(raw)
        # Every entry is compared, and the match folded in arithmetically: no
        # early exit and no branch on which entry matched (PROTOCOL.md: "Keys
        # are compared in constant time").
        bits = 0
        for digest, scope_bits in self._entries:
            bits |= scope_bits * hmac.compare_digest(digest, presented)
        kid = presented.hex()[:_KEY_ID_HEX]
        if not bits:
            raise Unauthorized("unknown API key", reason="unknown_key", key_id=kid)
        granted = bits & self._accepts[need]
        if not granted:
            accepted = ", ".join(sorted(s.value for s in _bits_to_scopes(self._accepts[need])))
            raise Forbidden(
                f"key {kid} may not do this: it needs a key of scope {accepted}",
                key_id=kid,
                need=need,
            )
        return Principal(
            kid,
            _bits_to_scopes(_ALL_BITS if bits & _BIT[Scope.ADMIN] else bits),
            _used_scope(granted, need),
        )

    def __repr__(self) -> str:
        per_scope = {
            scope.value: sum(1 for _, bits in self._entries if bits & _BIT[scope])
            for scope in Scope
        }
        shown = ", ".join(f"{name}={count}" for name, count in per_scope.items() if count)
        return f"KeyRing({shown or 'no keys: auth disabled'})"

    def key_ids(self) -> tuple[str, ...]:
        """The `key_id` of every configured key (for ``stepd serve`` to print at start)."""
        return self._ids


def _used_scope(granted: int, need: Need) -> Scope:
    """The scope recorded as used: the most specific one that granted the call.

    The need's own scope, then ``write``, then ``execute`` (PROTOCOL.md's "write,
    then execute" order for reads), then ``admin``: a key configured as both
    ``worker`` and ``admin`` is recorded as ``worker`` on a claim, the least
    privilege the call needed.
    """
    for scope in (_PRIMARY[need], Scope.WRITE, Scope.EXECUTE, Scope.ADMIN):
        if granted & _BIT[scope]:
            return scope
    raise AssertionError("granted is non-empty")  # pragma: no cover


def _check_key(raw: object, where: str) -> None:
    if not isinstance(raw, str):
        raise Invalid(f"a key must be a string, got {type(raw).__name__}", field=where)
    if not raw:
        raise Invalid("a key must not be empty", field=where)
    if any(not ("!" <= ch <= "~") for ch in raw):
        # Bearer tokens are visible ASCII (RFC 6750 b64token is narrower still);
        # a key with a space or a newline could never be presented.
        raise Invalid(
            "a key may hold only visible ASCII characters (no spaces or control "
            "characters); generate one with secrets.token_urlsafe(32)",
            field=where,
        )


def _bearer_token(authorization: str | None) -> str:
    if authorization is None or not authorization.strip():
        raise Unauthorized("an Authorization: Bearer <key> header is required", reason="missing")
    scheme, _, rest = authorization.strip().partition(" ")
    token = rest.strip(" ")
    if scheme.lower() != "bearer" or not token or any(not ("!" <= ch <= "~") for ch in token):
        raise Unauthorized("the Authorization header must read 'Bearer <key>'", reason="malformed")
    return token


# -- bind address ---------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names only this machine: ``localhost``, 127.0.0.0/8 or ::1.

    ``0.0.0.0``, ``::`` and the empty host (every interface) are not loopback,
    nor is any other name (resolving it would be I/O, and a name can change).
    IPv6 may be written in brackets; an IPv4-mapped loopback (``::ffff:127.0.0.1``)
    counts. Cached: a keyless daemon checks every request's ``Host`` header, and
    parsing the address was ~1 % of the daemon's CPU under load.
    """
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name.lower() in ("localhost", "localhost."):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_bind_address(host: str, keyring: KeyRing) -> None:
    """Refuse to serve without keys on an address other machines can reach.

    PROTOCOL.md: "With no key configured at all, the daemon serves without auth,
    and only on a loopback address; it refuses to start on a non-loopback address
    without keys."

    Args:
        host: the address ``stepd serve`` is about to listen on.
        keyring: the configured keys.

    Raises:
        Invalid: no key is configured and ``host`` is not loopback
            (``field="listen"``).
    """
    if keyring.enabled or is_loopback_host(host):
        return
    raise Invalid(
        f"refusing to listen on {host!r} without API keys: anyone who can reach it "
        "could run and read workflows. Configure keys (see docs/http-api.md), or "
        "listen on 127.0.0.1",
        field="listen",
    )
