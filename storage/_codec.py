"""The one msgpack codec for values stored in LMDB.

Values are encoded with ``use_bin_type=True`` (``bytes`` stay ``bytes``, ``str``
stays ``str``) and decoded with ``raw=False`` and ``strict_map_key=False`` (map
keys may be ints or bytes, not only strings). Things to know:

* Tuples come back as lists (msgpack has one array type). Compare decoded
  values with lists, or convert on the way out.
* Integers must fit in 64 bits (signed or unsigned); anything larger raises
  ``OverflowError`` when encoding.
* A dict whose keys are tuples cannot be decoded (the keys come back as lists,
  which are unhashable); use string or integer keys.
* Only msgpack types are supported: ``None``, ``bool``, ``int``, ``float``,
  ``str``, ``bytes``, ``list``/``tuple``, ``dict``. Anything else raises
  ``TypeError`` when encoding, before any transaction is touched.
"""

from __future__ import annotations

import threading

import msgpack  # type: ignore[import-untyped]  # no stubs published

__all__ = ["decode", "encode"]

#: One ``Packer`` per thread (the event loop's and the writer's both encode): a
#: ``Packer`` is not thread-safe, and ``msgpack.packb`` builds a new one on every
#: call (~1 us and a Python call of its own, ~10 times a step).
_local = threading.local()


def encode(value: object) -> bytes:
    """Encode a value for storage.

    Args:
        value: any msgpack-serialisable value.

    Returns:
        The msgpack bytes.

    Raises:
        TypeError: the value (or something inside it) is not serialisable.
        OverflowError: an integer does not fit in 64 bits.
    """
    try:
        packer = _local.packer
    except AttributeError:
        # autoreset: each pack starts from an empty buffer, also after a failed one
        packer = _local.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    return packer.pack(value)  # type: ignore[no-any-return]


def decode(data: bytes) -> object:
    """Decode bytes written by :func:`encode`.

    Args:
        data: msgpack bytes.

    Returns:
        The value, with tuples turned into lists.

    Raises:
        ValueError: the bytes are not valid msgpack (``msgpack`` raises
            subclasses of ``ValueError``).
    """
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
