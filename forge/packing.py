"""``Packed``: many payloads as a few flat tensors, declared once per type.

Monarch serialises every tensor of a message separately, at a fixed cost per tensor (send and
receive; ``docs/benchmarks.md``), so 128 episodes as objects are 512 tensors per hop; packed,
the same episodes are ten. A packed payload is a dataclass deriving from ``Packed`` whose fields
say what they are: ``per_item`` (one entry per item: a tensor ``[B]`` or a list), ``per_token``
(the items' tokens concatenated, cut by a per-item lengths field) or ``shared`` (one value for
the whole batch). From those declarations alone ``Packed`` builds, joins, slices, splits and
checks every payload the same way; ``Groups`` sends a list of payloads as one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace
from typing import Any, Generic, TypeVar

import torch

from forge.wire import for_wire, split_for_wire

_COLUMN = "forge.packed"
_REQUIRED = object()


@dataclass(frozen=True)
class _Column:
    kind: str  # "item", "token" or "shared"
    lengths: str | None  # a token column's per-item lengths field
    dtype: torch.dtype | None  # an item column's tensor dtype (None: a list); a token column's dtype
    fill: Any  # an optional column's value for an item (or token) that has none


def _declare(column: _Column) -> Any:
    if column.fill is _REQUIRED:
        return field(metadata={_COLUMN: column})
    return field(default=None, metadata={_COLUMN: column})


def per_item(dtype: torch.dtype | None = None, *, fill: Any = _REQUIRED) -> Any:
    """A field with one entry per item: a ``dtype`` tensor ``[B]``, or a list of B without one.
    With ``fill`` it is optional (None), and an item without one counts as ``fill``."""
    return _declare(_Column("item", None, dtype, fill))


def per_token(lengths: str, dtype: torch.dtype, *, fill: Any = _REQUIRED) -> Any:
    """A flat ``dtype`` tensor: the items' pieces one after another, cut by the ``lengths`` field.
    With ``fill`` it is optional (None), and an item without one has all its entries ``fill``."""
    return _declare(_Column("token", lengths, dtype, fill))


def shared() -> Any:
    """One value for every item of the batch (a prompt, a policy version, a group size)."""
    return _declare(_Column("shared", None, None, _REQUIRED))


@functools.cache
def _columns(cls: type) -> dict[str, _Column]:
    return {f.name: f.metadata[_COLUMN] for f in fields(cls) if _COLUMN in f.metadata}


def _lengths_list(value: torch.Tensor | list[int]) -> list[int]:
    return value.tolist() if isinstance(value, torch.Tensor) else list(value)


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _filled(column: _Column, n: int) -> torch.Tensor | list:
    if column.dtype is None:
        return [column.fill] * n
    return torch.full((n,), column.fill, dtype=column.dtype)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


P = TypeVar("P", bound="Packed")


class Packed:
    """The operations of a packed payload, read from its fields' declarations (module docstring)."""

    def __len__(self) -> int:
        for name, column in _columns(type(self)).items():
            value = getattr(self, name)
            if column.kind == "item" and value is not None:
                return int(value.numel()) if isinstance(value, torch.Tensor) else len(value)
        raise TypeError(f"{type(self).__name__} declares no per_item field")

    @classmethod
    def build(cls: type[P], **values: Any) -> P:
        """The payload of per-item values: a list per ``per_item`` field, a list of tensor pieces
        per ``per_token`` field (a lengths field left out is the pieces' lengths; a None piece of
        an optional field is filled), a value per ``shared`` field."""
        columns = _columns(cls)
        lengths: dict[str, list[int]] = {}
        for name, column in columns.items():
            pieces = values.get(name)
            if column.kind == "token" and pieces is not None and all(p is not None for p in pieces):
                lengths.setdefault(column.lengths, [int(p.numel()) for p in pieces])
        out: dict[str, Any] = {}
        for name, column in columns.items():
            value = values.get(name)
            if column.kind == "item" and value is None and name in lengths:
                value = lengths[name]
            if value is None or column.kind == "shared":
                out[name] = value
            elif column.kind == "item":
                if column.fill is not _REQUIRED:
                    value = [column.fill if v is None else v for v in value]
                out[name] = list(value) if column.dtype is None else torch.tensor(value, dtype=column.dtype)
            elif all(p is None for p in value) and column.fill is not _REQUIRED:
                out[name] = None
            else:
                sizes = lengths[column.lengths]
                out[name] = torch.cat(
                    [torch.zeros(0, dtype=column.dtype)]
                    + [
                        torch.full((n,), column.fill, dtype=column.dtype) if p is None else p.to(column.dtype)
                        for p, n in zip(value, sizes)
                    ]
                )
        return cls(**out)

    @classmethod
    def concat(cls: type[P], batches: list[P]) -> P:
        """One payload of ``batches``' items, batch after batch (the inverse of ``split``); their
        ``shared`` fields must agree."""
        if not batches:
            raise ValueError(f"{cls.__name__}.concat needs at least one batch")
        out: dict[str, Any] = {}
        for name, column in _columns(cls).items():
            values = [getattr(b, name) for b in batches]
            if column.kind == "shared":
                if any(not _same(v, values[0]) for v in values[1:]):
                    raise ValueError(f"{cls.__name__}.concat: the batches' {name} differ; they must be equal")
                out[name] = values[0]
                continue
            if all(v is None for v in values):
                out[name] = None
                continue
            sizes = [
                len(b) if column.kind == "item" else sum(_lengths_list(getattr(b, column.lengths))) for b in batches
            ]
            values = [_filled(column, n) if v is None else v for v, n in zip(values, sizes)]
            if isinstance(values[0], torch.Tensor):
                out[name] = torch.cat(values)
            else:
                out[name] = [x for v in values for x in v]
        return cls(**out)

    def rows(self: P, start: int, stop: int) -> P:
        """Items ``start`` to ``stop`` (exclusive) as a payload of their own, each field a slice that
        may be sent on alone (``forge.wire.for_wire``)."""
        columns = _columns(type(self))
        offsets = {
            c.lengths: _offsets(_lengths_list(getattr(self, c.lengths))) for c in columns.values() if c.kind == "token"
        }
        out: dict[str, Any] = {}
        for name, column in columns.items():
            value = getattr(self, name)
            if value is None or column.kind == "shared":
                out[name] = value
                continue
            a, b = (
                (start, stop)
                if column.kind == "item"
                else (offsets[column.lengths][start], offsets[column.lengths][stop])
            )
            out[name] = for_wire(value[a:b]) if isinstance(value, torch.Tensor) else value[a:b]
        return replace(self, **out)

    def split(self: P, sizes: list[int]) -> list[P]:
        """Consecutive payloads of ``sizes`` items each (the inverse of ``concat``)."""
        if any(n < 1 for n in sizes) or sum(sizes) != len(self):
            raise ValueError(
                f"split sizes {sizes} must be positive and add up to the {type(self).__name__}'s {len(self)} items"
            )
        bounds = _offsets(sizes)
        return [self.rows(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def chunks(self: P, size: int) -> list[P]:
        """Consecutive payloads of ``size`` items (the last may be shorter)."""
        n = len(self)
        return [self.rows(a, min(a + size, n)) for a in range(0, n, size)]

    def pieces(self, name: str) -> list[torch.Tensor]:
        """A ``per_token`` field cut into one tensor per item, each of which may be sent on alone."""
        column = _columns(type(self))[name]
        if column.kind != "token":
            raise ValueError(f"{type(self).__name__}.{name} is not a per_token field")
        return split_for_wire(getattr(self, name), _lengths_list(getattr(self, column.lengths)))

    def check(self) -> None:
        """``ValueError`` naming the field whose entries do not fit the payload's items or tokens."""
        n = len(self)
        for name, column in _columns(type(self)).items():
            value = getattr(self, name)
            if value is None or column.kind == "shared":
                continue
            got = int(value.numel()) if isinstance(value, torch.Tensor) else len(value)
            want = n if column.kind == "item" else sum(_lengths_list(getattr(self, column.lengths)))
            if got != want:
                unit = "items" if column.kind == "item" else f"tokens (the sum of {column.lengths})"
                raise ValueError(f"{type(self).__name__}.{name} has {got} entries, expected {want}: its {unit}")


@dataclass
class Groups(Generic[P]):
    """Several payloads of one type as one and each one's size: how a list of groups crosses a
    process. Sent as a list, every group costs Monarch its own tensors (64 groups of ten: 640,
    most of the controller's CPU in a tiny run); joined, the list costs ten."""

    batch: P
    sizes: list[int]

    @classmethod
    def pack(cls, groups: list[P]) -> Groups[P]:
        if not groups:
            raise ValueError("Groups.pack needs at least one group")
        return cls(type(groups[0]).concat(groups), [len(g) for g in groups])

    def unpack(self) -> list[P]:
        return self.batch.split(self.sizes)
