"""Every run's newest adapter on one multi-adapter policy replica, kept on disk until it is loaded.

Why a catalog: a replica holds at most ``max_loras`` adapters in vLLM, but serves more runs than
that. Each run's weight sync reaches every replica (so a replica that loads the adapter later
serves the run's newest version, never an older one), while only the replica's multiplexing
decides which adapters are in vLLM. So a sync records the version here, as a folder this replica
owns (written from the tensors by the run's own ``AdapterInbox``), and a load reads the newest
folder from here. A folder the trainer wrote is not used: the trainer reuses its folders, and an
adapter may be loaded long after its version was published.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from forge.generation.adapter_inbox import AdapterInbox
from forge.models.lora import LoraSettings

__all__ = ["AdapterCatalog", "UnknownAdapter"]


class UnknownAdapter(KeyError):
    """A request named an adapter this policy was never told to serve (or was told to forget)."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


@dataclass
class _Entry:
    inbox: AdapterInbox
    folder: str | None = None  # None: no version published yet, the run samples the base (version 0)
    version: int = 0


class AdapterCatalog:
    """Adapter id -> its newest version's folder on this replica (or the base, before the first)."""

    def __init__(self, settings: LoraSettings, base_model: str) -> None:
        self.settings = settings
        self.base_model = base_model
        self._entries: dict[str, _Entry] = {}

    def add(self, adapter_id: str) -> None:
        """Serve ``adapter_id`` from now on, as the base (version 0) until its first version."""
        _check_id(adapter_id)
        if adapter_id not in self._entries:
            self._entries[adapter_id] = _Entry(AdapterInbox(self.settings, self.base_model, weights_dir=None))

    def receive(
        self, adapter_id: str, adapter: Mapping[str, torch.Tensor], version: int, rollback: bool = False
    ) -> str:
        """Record ``version`` of ``adapter_id`` (its tensors, PEFT names) as its newest; returns
        the folder it is in. A version older than the one recorded is a ``ValueError`` (a late
        sync must not roll a run back) unless ``rollback``: a run restored from a checkpoint."""
        entry = self._entry(adapter_id)
        if isinstance(adapter, str):
            raise ValueError(
                f"a multi-adapter policy takes each version's adapter tensors (weight_sync.transport 'message'), "
                f"got the path {adapter!r}"
            )
        if version < entry.version and not rollback:
            raise ValueError(f"adapter {adapter_id!r}: version {version} is older than the {entry.version} it serves")
        entry.folder = entry.inbox.receive(adapter, version)
        entry.version = version
        entry.inbox.loaded()  # only the newest folder stays on disk
        return entry.folder

    def newest(self, adapter_id: str) -> tuple[str | None, int]:
        """The folder and version to load for ``adapter_id`` (None, 0: the base)."""
        entry = self._entry(adapter_id)
        return entry.folder, entry.version

    def forget(self, adapter_id: str) -> bool:
        """Stop serving ``adapter_id`` and remove its folders; False if it was not served."""
        entry = self._entries.pop(adapter_id, None)
        if entry is None:
            return False
        entry.inbox.close()
        return True

    def ids(self) -> list[str]:
        return sorted(self._entries)

    def close(self) -> None:
        for adapter_id in list(self._entries):
            self.forget(adapter_id)

    def _entry(self, adapter_id: str) -> _Entry:
        entry = self._entries.get(adapter_id)
        if entry is None:
            raise UnknownAdapter(
                f"adapter {adapter_id!r} is not served by this policy (it serves {self.ids()}); a run adds its "
                "adapter with add_adapter before its first request"
            )
        return entry


def _check_id(adapter_id: object) -> None:
    if not isinstance(adapter_id, str) or not adapter_id:
        raise ValueError(f"an adapter id must be a non-empty string (the run's name), got {adapter_id!r}")
