"""The OpenAPI 3.1 document of the HTTP API, shipped next to this module as ``openapi.json``.

The document is written by hand (it is the contract the schemathesis suite fuzzes
the live daemon against), not generated from the handlers: generating it from
the code would make the contract agree with whatever the code does. Read it with
`load_openapi`; docs/http-api.md explains the decisions it encodes.
"""

from __future__ import annotations

import copy
import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any, Final

__all__ = ["OPENAPI_FILE", "load_openapi", "openapi_bytes"]

OPENAPI_FILE: Final = "openapi.json"


@functools.cache
def openapi_bytes() -> bytes:
    """The document as stored (UTF-8 JSON), read once (e.g. to serve it verbatim).

    Read through `importlib.resources`, so it works from a wheel or a zip. If the
    package data is missing there (a strict editable install links only declared
    files), the file beside the real module is used.

    Raises:
        FileNotFoundError: the document is not installed.
    """
    try:
        return resources.files(__package__).joinpath(OPENAPI_FILE).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return (Path(__file__).resolve().parent / OPENAPI_FILE).read_bytes()


@functools.cache
def _parsed() -> dict[str, Any]:
    document = json.loads(openapi_bytes())
    if not isinstance(document, dict):
        raise TypeError(f"{OPENAPI_FILE} is not a JSON object")
    return document


def load_openapi() -> dict[str, Any]:
    """The OpenAPI document as a dict, parsed once and copied per call.

    A copy, so a caller that edits it (a test adding a server URL) cannot change
    what the next caller sees.

    Raises:
        FileNotFoundError: the document is not installed.
        TypeError: it is not a JSON object.
    """
    return copy.deepcopy(_parsed())
