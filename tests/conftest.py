"""Test-session setup shared by every test.

forge.controller is imported first so that Monarch reads forge's settings (1 s failure
detection, quiet log file) and forge's fault hook replaces Monarch's exit-on-fault hook.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import forge.controller  # noqa: E402,F401  (before anything imports monarch)
from forge.controller.provisioner import install_fault_hook  # noqa: E402

install_fault_hook()
