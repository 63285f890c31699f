"""vLLM's start-up scan of every module's globals must not meet a Flask context-local proxy
(forge.generation.module_scan); Monarch's job module imports Flask, so a test run has some."""

from __future__ import annotations

import sys

import pytest


def test_modules_holding_context_proxies_are_out_of_sys_modules_inside_and_back_after() -> None:
    flask_globals = pytest.importorskip("flask.globals")  # installed with torchmonarch (its dashboard)
    from werkzeug.local import LocalProxy

    from forge.generation.module_scan import without_context_proxies

    with pytest.raises(RuntimeError):  # what vLLM's scan asks of each value, outside an app context
        hasattr(flask_globals.current_app, "__dict__")
    with without_context_proxies():
        for module in list(sys.modules.values()):
            for value in list((getattr(module, "__dict__", None) or {}).values()):
                assert type(value) is not LocalProxy, module
    assert sys.modules["flask.globals"] is flask_globals
