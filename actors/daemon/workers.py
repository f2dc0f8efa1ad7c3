"""Worker registration rules: protocol version negotiation and the capability manifest.

AFFINITY.md "Version negotiation and the capability manifest": `register`
takes the worker's ``protocol_version``, the answer carries the lower of the
two, and capability declarations need 1.18 or later with a manifest that
marks each of ``local_steps``, ``sessions`` and ``sticky`` supported or
rejected. Pure functions: the API calls them before it writes anything.
"""

from __future__ import annotations

from typing import Any

from stepd.sansio.capabilities import CAPABILITIES, MIN_CAPABILITY_VERSION, version_tuple
from stepd.sansio.errors import Invalid

__all__ = ["CAPABILITIES", "PROTOCOL_VERSION", "check_capabilities", "negotiate"]

#: The protocol version this daemon speaks up to (AFFINITY.md).
PROTOCOL_VERSION = "1.20"


def negotiate(version: Any, ours: str) -> str:
    """The lower of the worker's protocol version and ours (AFFINITY.md).

    Raises:
        Invalid: not a "MAJOR.MINOR" string.
    """
    if not isinstance(version, str):
        raise Invalid('must be a "MAJOR.MINOR" string', field="protocol_version")
    try:
        major, minor = (int(p) for p in version.split("."))
    except ValueError:
        raise Invalid('must be a "MAJOR.MINOR" string', field="protocol_version") from None
    mine_max = tuple(int(p) for p in ours.split("."))
    if major < 1:
        raise Invalid("must be at least 1.0", field="protocol_version")
    mine = (major, minor)
    low = min(mine, mine_max)
    return f"{low[0]}.{low[1]}"


def check_capabilities(negotiated: str, capabilities: Any, manifest: Any) -> None:
    """AFFINITY.md "Version negotiation and the capability manifest".

    Raises:
        Invalid: naming the field.
    """
    if not isinstance(capabilities, list) or not all(isinstance(c, str) for c in capabilities):
        raise Invalid("must be a list of strings", field="capabilities")
    if version_tuple(negotiated) < MIN_CAPABILITY_VERSION:
        if capabilities or manifest:
            raise Invalid("capability declarations need protocol version 1.18 or later",
                          field="capabilities" if capabilities else "manifest")
        return
    if manifest is None:
        if capabilities:
            raise Invalid("a capability needs a manifest marking it supported", field="manifest")
        return
    if not isinstance(manifest, dict):
        raise Invalid("must be an object", field="manifest")
    for cap in CAPABILITIES:
        entry = manifest.get(cap)
        if not isinstance(entry, dict) or entry.get("status") not in ("supported", "rejected"):
            raise Invalid('must declare {"status": "supported" | "rejected"}', field=f"manifest.{cap}")
    unknown = set(manifest) - set(CAPABILITIES)
    if unknown:
        raise Invalid(f"unknown capability {sorted(unknown)[0]!r}", field="manifest")
    for cap in capabilities:
        if cap not in CAPABILITIES:
            raise Invalid(f"unknown capability {cap!r}", field="capabilities")
        if manifest[cap]["status"] != "supported":
            raise Invalid(f"{cap!r} is not marked supported in the manifest", field="capabilities")

