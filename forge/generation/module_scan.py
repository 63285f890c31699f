"""Keep vLLM's start-up scan of every imported module away from context-local proxies.

At engine start vLLM's CPU platform rebinds its Triton kernels by walking the globals of every
module in ``sys.modules`` and asking each value ``hasattr(value, "__dict__")``. A Flask or
werkzeug context-local proxy (``flask.current_app``, ``flask.request``...) answers that outside
an application context by raising ``RuntimeError``, which fails the engine's start. Monarch's
``monarch.job`` imports its Flask dashboard, so any process that touched a Monarch job (a test
run, a notebook) and then starts an in-process engine would fail. ``without_context_proxies``
takes the modules that hold such proxies out of ``sys.modules`` while the engine starts and
puts them back after; the module objects themselves are untouched.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

__all__ = ["without_context_proxies"]


def _modules_with_proxies(proxy_type: type) -> dict[str, ModuleType]:
    found = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) or {}
        # type(), not isinstance(): a proxy forwards __class__ to the object it stands for.
        if any(type(value) is proxy_type for value in list(namespace.values())):
            found[name] = module
    return found


@contextmanager
def without_context_proxies() -> Iterator[None]:
    """Inside, no module in ``sys.modules`` holds a werkzeug ``LocalProxy`` at module level."""
    local = sys.modules.get("werkzeug.local")
    if local is None:  # nothing imported werkzeug: nothing to hide
        yield
        return
    hidden = _modules_with_proxies(local.LocalProxy)
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        for name, module in hidden.items():
            sys.modules.setdefault(name, module)
