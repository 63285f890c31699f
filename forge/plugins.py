"""The code a config names: ``package.module:attr`` for rewards, dataset factories and environments.

Naming code in a config means importing and running it in the processes that use it (the
controller, a reward or environment replica): it is trusted like any other code of the run.
One function resolves every such name, so all of them fail the same way: a ``ValueError`` that
names the spec, what it was meant to be and why it could not be had.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_object"]


def import_object(spec: str, what: str, form: str = "attr") -> Any:
    """The object ``spec`` (``"package.module:attr"``) names; ``what`` says what it is for and
    ``form`` what the attribute is (``Class``, ``function``), in errors."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{what} must be named 'package.module:{form}', got {spec!r}")
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {spec!r} cannot be imported: {exc!r}") from exc
