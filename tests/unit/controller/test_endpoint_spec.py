"""``EndpointSpec``: each endpoint's facts declared once by ``@endpoint`` (no meshes needed)."""

import pytest
from monarch.actor import endpoint as monarch_endpoint

from forge.controller import Batching, ForgeActor, endpoint, model_loader
from forge.controller.endpoint import endpoint_specs


class Declared(ForgeActor):
    @model_loader(max_models=2)
    async def load_model(self, model_id: str) -> str:
        return model_id

    @endpoint(batch=Batching(max_size=4))
    async def batched(self, items: list[int]) -> list[int]:
        return items

    @endpoint(batch=Batching(max_size=4), concurrent=True)
    async def batched_concurrent(self, items: list[int]) -> list[int]:
        return items

    @endpoint(batch=Batching(max_size=4), multiplexed=True)
    async def per_model(self, model: str, items: list[int]) -> list[int]:
        return items

    @endpoint(retry=False)
    async def once(self, x: int, *, scale: int = 1) -> int:
        return x * scale

    @monarch_endpoint
    async def monarchs(self, y: str) -> str:
        return y


def test_each_endpoint_has_one_spec_with_what_its_decorator_said():
    specs = endpoint_specs(Declared)
    assert specs["batched"].batched and specs["batched"].retry and not specs["batched"].concurrent
    assert specs["once"].retry is False and not specs["once"].batched
    assert specs["per_model"].multiplexed and specs["per_model"].batching.max_size == 4
    assert str(specs["once"].signature) == "(x: int, *, scale: int = 1) -> int"  # self dropped
    assert {"setup", "drain_metrics", "_forge_health"} <= set(specs)  # ForgeActor's own endpoints


def test_only_one_message_at_a_time_endpoints_send_full_batches_past_the_slots():
    specs = endpoint_specs(Declared)
    assert specs["batched"].send_full
    assert not specs["batched_concurrent"].send_full  # they would run at once
    assert not specs["per_model"].send_full  # a model's batches wait for its load
    assert not specs["once"].send_full


def test_a_monarch_endpoint_gets_the_defaults_and_its_signature():
    spec = endpoint_specs(Declared)["monarchs"]
    assert (spec.batching, spec.retry, spec.multiplexed, spec.concurrent) == (None, True, False, False)
    assert str(spec.signature) == "(y: str) -> str"


def test_a_bad_assembly_name_fails_when_the_specs_are_read():
    class BadAssembly(ForgeActor):
        @endpoint(batch=Batching(enbatch="no_such_method"))
        async def ep(self, items: list) -> list:
            return items

    with pytest.raises(TypeError, match="BadAssembly has no static or class method named 'no_such_method'"):
        endpoint_specs(BadAssembly)
