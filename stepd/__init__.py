"""stepd: a durable step orchestrator for Python.

The public API grows issue by issue; see README.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
