"""Small tensors cross processes as numpy arrays instead of through ``torch.save``.

Monarch 0.7 pickles every tensor in a message by its storage, and every storage with a
``torch.save`` of its own (legacy format): about 40 µs to pickle and 50 µs to unpickle one
tiny tensor, whatever its size. A GRPO step sends several small tensors per sequence (token
ids, logprobs) and a multi-turn step one per turn, so this fixed cost was most of the
controller's Python time per sequence. A numpy array pickles its bytes directly, in a few µs.

``install()`` puts a reducer for plain tensors (CPU, strided, no autograd, a dtype numpy has, or
bfloat16 viewed as int16) ahead of Monarch's own, in Monarch's message picklers only: ``torch.save``
and checkpoints are untouched. Other tensors (parameters, DTensors, GPU tensors, tensors that
require grad, large ones) keep Monarch's path. A tensor arrives as a copy of its own elements:
views of one storage no longer share it after the trip (they never shared memory across
processes anyway), and a slice of a large storage sends only its slice.

It is a patch of Monarch's private module ``monarch._src.actor.pickle``: when that module changes
shape, ``install`` logs that the fast path is off and Monarch's path is used as before.
``FORGE_FAST_TENSORS=0`` turns it off (to compare, or to rule it out).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger("forge.wire")

MAX_FAST_BYTES = 1 << 20
"""Largest tensor that takes the numpy path; larger ones (weights) keep Monarch's path, whose
per-tensor cost is small beside their size."""

_NUMPY_FREE = {torch.bfloat16: torch.int16}
"""Dtypes numpy lacks, sent as a same-width integer view and viewed back on arrival."""

_installed = False


def _rebuild(array: Any, dtype: str | None) -> torch.Tensor:
    """The receiving side: the array's memory becomes the tensor's (no copy)."""
    tensor = torch.from_numpy(array)
    return tensor.view(getattr(torch, dtype)) if dtype else tensor


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    """``(rebuild, args)`` for a plain small CPU tensor; Monarch's own reduction otherwise."""
    if (
        tensor.device.type != "cpu"
        or tensor.layout is not torch.strided
        or tensor.requires_grad
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.numel() * tensor.element_size() > MAX_FAST_BYTES
    ):
        return tensor.__reduce_ex__(4)
    view = _NUMPY_FREE.get(tensor.dtype)
    try:
        array = (tensor.view(view) if view is not None else tensor).numpy()
    except (TypeError, RuntimeError):  # a dtype numpy has no match for (float8, quantized, ...)
        return tensor.__reduce_ex__(4)
    return _rebuild, (array, str(tensor.dtype).removeprefix("torch.") if view is not None else None)


def install() -> bool:
    """Put ``_reduce_tensor`` into Monarch's message picklers (idempotent); False if it could not."""
    global _installed
    if _installed:
        return True
    if os.environ.get("FORGE_FAST_TENSORS", "1") == "0":
        return False
    try:
        from monarch._src.actor import pickle as monarch_pickle

        monarch_pickle._Pickler._dispatch_table[torch.Tensor] = _reduce_tensor
        monarch_pickle._ensure_torch_pickle()
        monarch_pickle._TorchPickler.dispatch_table.maps[0][torch.Tensor] = _reduce_tensor
    except (ImportError, AttributeError, IndexError, TypeError) as exc:
        logger.info("forge's fast tensor pickling is off (Monarch's pickling changed: %r)", exc)
        return False
    _installed = True
    return True


def for_wire(piece: torch.Tensor) -> torch.Tensor:
    """A slice of a larger tensor that may be sent on alone: the view itself where the fast path
    sends it (only its own elements), else a copy (Monarch's path, which a slice over
    ``MAX_FAST_BYTES`` also takes, would send the whole storage with it)."""
    if _installed and piece.numel() * piece.element_size() <= MAX_FAST_BYTES:
        return piece
    return piece.clone()


def split_for_wire(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """``flat`` cut into pieces of ``lengths``, each of which may be sent on alone (``for_wire``)."""
    return [for_wire(piece) for piece in torch.split(flat, lengths)]
