"""A model's layout in one line, read off its tensors' names and shapes.

A resume from a checkpoint of another model fails on the first tensor that differs, which says
little about what went wrong ("embed_tokens.weight is [512, 64] but [512, 128]"). Both sides'
layouts, side by side ("2 layers, hidden 64, vocab 512, 0.1M params" against "4 layers, hidden
128, ..."), tell the user which model each one is. The layout is derived from shapes alone, so
it works for every checkpoint forge ever wrote, with no extra metadata saved.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def describe_layout(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """``"<L> layers, hidden <H>, vocab <V>, <P>M params"`` for a decoder's tensors by name;
    the parts that cannot be read off the names are left out (the parameter count never is)."""
    parts = []
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER_INDEX.search(name))}
    if layers:
        parts.append(f"{max(layers) + 1} layers")
    embedding = next((shape for name, shape in shapes.items() if name.endswith("embed_tokens.weight")), None)
    if embedding is not None and len(embedding) == 2:
        parts.append(f"hidden {embedding[1]}, vocab {embedding[0]}")
    params = sum(math.prod(shape) for shape in shapes.values())
    parts.append(f"{params / 1e6:.1f}M params" if params >= 50_000 else f"{params} params")
    return ", ".join(parts)
