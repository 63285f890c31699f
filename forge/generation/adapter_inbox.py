"""Where a LoRA policy gets each version's adapter folder, whichever way the trainer sent it.

vLLM loads an adapter from a folder in PEFT's format. The file transport hands the policy the
path of a folder the trainer wrote in the run's weight folder: it is checked to be there and
the user's, as weight files are (``forge.generation.weight_folder.check_weight_file``). The
message transport sends the adapter's tensors: they are written as a folder in a private
temporary folder of the policy's own. Either way the folder holds the adapter alone, so only the
adapter's bytes moved.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from forge.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSettings, write_adapter_folder

__all__ = ["AdapterInbox"]


class AdapterInbox:
    """Adapter folders of one LoRA policy: checks the trainer's, writes the ones sent as tensors."""

    def __init__(self, settings: LoraSettings, base_model: str, weights_dir: str | None) -> None:
        self.settings = settings
        self.base_model = base_model
        self.weights_dir = weights_dir
        self._own: Path | None = None  # made on the first adapter sent as tensors (0700)
        self._written: list[Path] = []

    def receive(self, adapter: Mapping[str, torch.Tensor] | str, version: int) -> str:
        """The folder to load for ``version``: ``adapter`` itself (a path) once checked, or the
        tensors written as a PEFT folder. A ``ValueError`` names what is wrong with either."""
        if isinstance(adapter, str):
            self._check_folder(adapter)
            return adapter
        bad = [k for k, v in adapter.items() if not isinstance(v, torch.Tensor) or "lora_" not in k]
        if not adapter or bad:
            raise ValueError(
                f"a LoRA policy loads adapter tensors (PEFT names with lora_A/lora_B), got "
                f"{bad[0] if bad else 'none'!r}"
            )
        if self._own is None:
            self._own = Path(tempfile.mkdtemp(prefix="forge-adapters-"))
        folder = Path(tempfile.mkdtemp(prefix=f"v{version}-", dir=self._own))
        write_adapter_folder(folder, adapter, self.settings, self.base_model)
        self._written.append(folder)
        return str(folder)

    def loaded(self) -> None:
        """The newest folder is in the engine: the ones this inbox wrote before it can go."""
        while len(self._written) > 1:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)

    def close(self) -> None:
        """Remove every folder this inbox wrote."""
        if self._own is not None:
            shutil.rmtree(self._own, ignore_errors=True)
            self._own = None
        self._written.clear()

    def _check_folder(self, folder: str) -> None:
        if self.weights_dir is not None:
            from forge.generation.weight_folder import check_weight_file

            for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                check_weight_file(Path(folder) / name, self.weights_dir)
        elif not (Path(folder) / ADAPTER_WEIGHTS).is_file():
            raise ValueError(f"{folder} is not an adapter folder: it has no {ADAPTER_WEIGHTS}")
