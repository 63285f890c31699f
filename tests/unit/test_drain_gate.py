"""DrainGate: a draining update waits for the calls in flight and holds new ones until it is done."""

import asyncio

from forge.generation.drain_gate import DrainGate


async def test_a_draining_update_waits_for_calls_in_flight_and_holds_new_ones_until_it_is_done():
    gate, order = DrainGate(), []
    first_may_end = asyncio.Event()

    async def call(name: str, until: asyncio.Event | None = None) -> None:
        async with gate.calling():
            order.append(f"{name} starts")
            if until is not None:
                await until.wait()
            order.append(f"{name} ends")

    async def update() -> None:
        async with gate.draining():
            order.append("load")
            await asyncio.sleep(0.01)
            order.append("loaded")

    first = asyncio.create_task(call("first", first_may_end))
    await asyncio.sleep(0)
    updating = asyncio.create_task(update())
    await asyncio.sleep(0)
    late = asyncio.create_task(call("late"))
    await asyncio.sleep(0.01)
    assert (gate.in_flight, gate.held) == (1, 1) and "load" not in order  # the drain waits; late is held
    first_may_end.set()
    await asyncio.gather(first, updating, late)
    assert order == ["first starts", "first ends", "load", "loaded", "late starts", "late ends"]
    assert (gate.in_flight, gate.held) == (0, 0)


async def test_two_updates_load_one_after_the_other():
    gate, loading, most = DrainGate(), 0, 0

    async def update() -> None:
        nonlocal loading, most
        async with gate.draining():
            loading += 1
            most = max(most, loading)
            await asyncio.sleep(0.01)
            loading -= 1

    await asyncio.gather(update(), update())
    assert most == 1
