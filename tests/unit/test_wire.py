"""Small tensors cross processes as numpy arrays (``forge.wire``): through Monarch's
own message pickler and a real actor on another process, every kind of tensor arrives equal,
with its dtype, shape and autograd flag; the ones the fast path leaves alone keep Monarch's."""

from __future__ import annotations

import io

import pytest
import torch
from monarch._src.actor import pickle as monarch_pickle

from forge import wire
from forge.controller import ForgeActor, endpoint

TENSORS = {
    "int64": torch.arange(10),
    "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    "bfloat16": torch.linspace(-2, 2, 5, dtype=torch.bfloat16),
    "scalar": torch.tensor(3.5),
    "bool": torch.tensor([True, False]),
    "slice of a larger storage": torch.arange(1000)[10:20],
    "empty": torch.empty(0, 3),
    "requires grad": torch.ones(2, 2, requires_grad=True),
    "parameter": torch.nn.Parameter(torch.ones(3)),
    "large": torch.ones(300_000),
}


def _round_trip(value):
    buffer = io.BytesIO()
    monarch_pickle.torch_dump(value, buffer)
    return monarch_pickle.torch_loads(buffer.getvalue()), len(buffer.getvalue())


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        type(got) is type(want)
        and got.dtype == want.dtype
        and got.shape == want.shape
        and got.requires_grad == want.requires_grad
        and torch.equal(got.detach(), want.detach())
    )


def test_the_fast_path_is_in_monarchs_message_picklers_only():
    assert wire.install()
    assert monarch_pickle._TorchPickler.dispatch_table[torch.Tensor] is wire._reduce_tensor
    assert monarch_pickle._Pickler.dispatch_table[torch.Tensor] is wire._reduce_tensor
    # torch.save (checkpoints, weight files) is untouched: a tensor saves and loads weights-only.
    buffer = io.BytesIO()
    torch.save(torch.arange(4), buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True), torch.arange(4))


@pytest.mark.parametrize("name", TENSORS)
def test_every_kind_of_tensor_round_trips_through_monarchs_pickler(name: str):
    got, _ = _round_trip(TENSORS[name])
    assert _same(got, TENSORS[name]), (name, got)


def test_a_slice_sends_its_own_elements_not_its_storage():
    """Ten elements of a 100,000-element storage: a message of about 80 bytes of data, not 800 KB."""
    _, size = _round_trip(torch.arange(100_000)[:10])
    assert size < 1_000, size


def test_pieces_for_the_wire_are_views_when_small_and_copies_over_the_fast_paths_limit():
    """split_for_wire: a piece the fast path sends (its own elements) stays a view; a piece over
    MAX_FAST_BYTES, which takes Monarch's path (the whole storage), is copied, so it sends only itself."""
    assert wire.install()
    big = wire.MAX_FAST_BYTES // 4 + 10  # float32 elements: just over the limit
    flat = torch.zeros(big + 10)
    small, large = wire.split_for_wire(flat, [10, big])
    assert small.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view
    assert large.untyped_storage().nbytes() == big * 4  # its own storage
    _, size = _round_trip(large)
    assert size < big * 4 + 10_000, size


def test_an_arrived_tensor_is_writable_and_owns_its_memory():
    got, _ = _round_trip(torch.arange(5))
    got += 1
    assert got.tolist() == [1, 2, 3, 4, 5]


class Echo(ForgeActor):
    @endpoint
    async def echo(self, tensors: dict) -> dict:
        return {name: t.clone() if not t.requires_grad else t for name, t in tensors.items()}


async def test_tensors_cross_a_real_process_and_come_back_equal():
    actor = await Echo.as_actor()
    try:
        got = await actor.echo.call_one(TENSORS)
        for name, want in TENSORS.items():
            assert _same(got[name], want), (name, got[name])
    finally:
        await ForgeActor.shutdown(actor)
