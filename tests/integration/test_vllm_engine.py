"""Both engine modes against transformers on the tiny model: logprobs, weight sync, bad input.

Each test runs on ``VllmEngine`` (one batched ``LLM.generate``) and on ``AsyncVllmEngine``
(``AsyncLLM``, one request per prompt). One engine of each mode serves the whole module
(start-up is ~3-10 s on CPU); tests that change its weights put the seed-0 weights back
afterwards (the ``engine`` fixture).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from forge.generation import AsyncVllmEngine, VllmEngine  # noqa: E402
from forge.models import sequence_logprobs  # noqa: E402
from forge.types import Completion  # noqa: E402
from tests.numerics import assert_close_to_scale  # noqa: E402

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 16
# The last prompt fills several KV blocks (32 tokens on CPU), so it exercises the prefix cache.
PROMPTS = ["3+7=", "12*4=", "what is 5-2?", "a", "1+2=" * 60]


Engine = VllmEngine | AsyncVllmEngine


async def settle(result: Any) -> Any:
    """An engine call's result: awaited for ``AsyncVllmEngine``, as is for ``VllmEngine``."""
    return await result if inspect.isawaitable(result) else result


@pytest.fixture(scope="module")
def batched_engine(tiny_model_dir: Path) -> Iterator[VllmEngine]:
    engine = VllmEngine.create(tiny_model_dir, max_model_len=512, seed=0)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
async def async_engine(tiny_model_dir: Path) -> AsyncIterator[AsyncVllmEngine]:
    engine = await AsyncVllmEngine.create(tiny_model_dir, max_model_len=512, seed=0)
    yield engine
    engine.shutdown()
    # Spawning the engine-core process started multiprocessing's resource tracker, which would
    # otherwise live until this process exits (the session checks no child is left behind).
    from multiprocessing import resource_tracker

    resource_tracker._resource_tracker._stop()


@pytest.fixture(params=["batched", "async"])
def _mode_engine(request: pytest.FixtureRequest) -> Engine:
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture
async def engine(_mode_engine: Engine, tiny_model_dir: Path) -> AsyncIterator[Engine]:
    """The module's engine of each mode, back on the seed-0 weights (version 0) after each test."""
    yield _mode_engine
    if _mode_engine.version != 0:
        await settle(_mode_engine.update_weights(load_file(str(tiny_model_dir / "model.safetensors")), 0))


def _hf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> torch.nn.Module:
    return _hf_model(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model_alt(tiny_model_dir_alt: Path) -> torch.nn.Module:
    return _hf_model(tiny_model_dir_alt)


def _flat(groups: list[list[Completion]]) -> list[Completion]:
    return [c for group in groups for c in group]


async def _greedy(engine: Engine) -> list[list[int]]:
    groups = await settle(engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=MAX_TOKENS))
    return [group[0].token_ids.tolist() for group in groups]


@torch.no_grad()
def _hf_greedy(model: torch.nn.Module, tokenizer, prompts: list[str]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time (no padding)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt).input_ids])
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS)
        out.append(seq[0, ids.shape[1] :].tolist())
    return out


async def test_generate_returns_n_completions_per_prompt_with_consistent_fields(
    engine: Engine, tiny_model_dir: Path
) -> None:
    """Each prompt gets n completions whose ids, logprobs, text and version agree."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    groups = await settle(engine.generate(PROMPTS, n=3, temperature=1.0, max_tokens=MAX_TOKENS, seed=0))
    assert [len(g) for g in groups] == [3] * len(PROMPTS)
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            assert c.prompt_ids.tolist() == tokenizer(prompt).input_ids
            assert c.token_ids.dtype == torch.int64 and c.logprobs.dtype == torch.float32
            assert c.token_ids.shape == c.logprobs.shape and 1 <= len(c.token_ids) <= MAX_TOKENS
            assert (c.logprobs <= 0).all()
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert c.policy_version == 0
            assert c.finish_reason in ("stop", "length")


async def test_token_id_prompts_match_string_prompts(engine: Engine, tiny_model_dir: Path) -> None:
    """A prompt given as token ids samples exactly what the same prompt as text samples."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    as_ids = [tokenizer(p).input_ids for p in PROMPTS]
    by_text = await settle(engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=3))
    by_ids = await settle(engine.generate(as_ids, n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=3))
    for a, b in zip(_flat(by_text), _flat(by_ids)):
        assert torch.equal(a.token_ids, b.token_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_behaviour_logprobs_match_transformers(
    engine: Engine, hf_model: torch.nn.Module, temperature: float
) -> None:
    """vLLM's logprob of each sampled token equals log_softmax(logits / T) from transformers."""
    completions = _flat(
        await settle(engine.generate(PROMPTS, n=4, temperature=temperature, max_tokens=MAX_TOKENS, seed=1))
    )
    expected = sequence_logprobs(
        hf_model,
        [c.prompt_ids for c in completions],
        [c.token_ids for c in completions],
        temperature=temperature,
    )
    got = torch.cat([c.logprobs for c in completions])
    assert_close_to_scale(got, torch.cat(expected), rel=1e-3, scale=1.0, what="vLLM vs transformers logprobs")


async def test_update_weights_switches_greedy_output_to_new_model(
    engine: Engine, hf_model_alt: torch.nn.Module, tiny_model_dir_alt: Path
) -> None:
    """After update_weights, greedy output is the new model's, token for token, at the new version."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir_alt)
    before = await _greedy(engine)  # also fills the prefix cache with blocks of the old weights
    await settle(engine.update_weights(hf_model_alt.state_dict(), version=1))  # holds the tied lm_head
    after = await settle(engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=MAX_TOKENS))

    assert engine.version == 1
    assert all(group[0].policy_version == 1 for group in after)
    assert [group[0].token_ids.tolist() for group in after] == _hf_greedy(hf_model_alt, tokenizer, PROMPTS)
    assert before != [group[0].token_ids.tolist() for group in after]


async def test_restoring_weights_restores_greedy_output(
    engine: Engine,
    hf_model: torch.nn.Module,
    tiny_model_dir: Path,
    tiny_model_dir_alt: Path,
) -> None:
    """Loading other weights and then the original ones (no lm_head key) gives the original output."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    await settle(engine.update_weights(load_file(str(tiny_model_dir_alt / "model.safetensors")), version=1))
    await _greedy(engine)
    await settle(engine.update_weights(load_file(str(tiny_model_dir / "model.safetensors")), version=2))
    assert engine.version == 2
    assert await _greedy(engine) == _hf_greedy(hf_model, tokenizer, PROMPTS)


def _missing(sd: dict) -> str:
    del sd["model.norm.weight"]
    return "model.norm.weight"


def _wrong_shape(sd: dict) -> str:
    key = "model.layers.0.mlp.up_proj.weight"
    sd[key] = sd[key].t().contiguous()
    return key


def _not_a_tensor(sd: dict) -> str:
    key = "model.layers.1.self_attn.q_proj.bias"
    sd[key] = sd[key].tolist()
    return key


def _unexpected(sd: dict) -> str:
    sd["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    return "model.layers.9.mlp.up_proj.weight"


@pytest.mark.parametrize("corrupt", [_missing, _wrong_shape, _not_a_tensor, _unexpected])
async def test_invalid_state_dict_is_rejected_and_engine_keeps_working(
    engine: Engine, tiny_model_dir_alt: Path, corrupt
) -> None:
    """A bad state dict raises ValueError naming the key; weights and version stay as they were."""
    before = await _greedy(engine)
    state_dict = load_file(str(tiny_model_dir_alt / "model.safetensors"))
    bad_key = corrupt(state_dict)
    with pytest.raises(ValueError, match=re.escape(repr(bad_key))):
        await settle(engine.update_weights(state_dict, version=7))
    assert engine.version == 0
    assert await _greedy(engine) == before


async def test_a_seed_per_prompt_gives_a_prompt_the_same_samples_whatever_shares_its_call(engine: Engine) -> None:
    """Seeds listed per prompt (``PolicySettings.prompt_seeds``): a prompt sampled alone, or in
    another order beside other prompts, draws the same tokens; another seed draws others."""
    from forge.actors.policy import prompt_seed

    seeds = [prompt_seed(f"p{i}", 0) for i in range(len(PROMPTS))]
    together = await settle(engine.generate(PROMPTS, n=4, temperature=1.0, max_tokens=MAX_TOKENS, seed=seeds))
    backwards = await settle(
        engine.generate(PROMPTS[::-1], n=4, temperature=1.0, max_tokens=MAX_TOKENS, seed=seeds[::-1])
    )
    alone = await settle(engine.generate(PROMPTS[:1], n=4, temperature=1.0, max_tokens=MAX_TOKENS, seed=seeds[:1]))
    tokens = lambda groups: [[c.token_ids.tolist() for c in g] for g in groups]  # noqa: E731
    assert tokens(together) == tokens(backwards)[::-1]
    assert tokens(alone) == tokens(together)[:1]
    other = await settle(
        engine.generate(PROMPTS, n=4, temperature=1.0, max_tokens=MAX_TOKENS, seed=[s + 1 for s in seeds])
    )
    assert tokens(other) != tokens(together)
    with pytest.raises(ValueError, match=f"seed lists 1 seeds for {len(PROMPTS)} prompts"):
        await settle(engine.generate(PROMPTS, n=1, temperature=1.0, max_tokens=MAX_TOKENS, seed=seeds[:1]))


async def test_generate_rejects_bad_arguments(engine: Engine) -> None:
    """Out-of-range sampling arguments and malformed prompts fail before reaching vLLM."""
    with pytest.raises(ValueError, match="n must be"):
        await settle(engine.generate(["1+1="], n=0, temperature=1.0, max_tokens=4))
    with pytest.raises(ValueError, match="top_p"):
        await settle(engine.generate(["1+1="], n=1, temperature=1.0, max_tokens=4, top_p=0.0))
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        await settle(engine.generate(["1+1=", 3.5], n=1, temperature=1.0, max_tokens=4))


async def test_stop_string_ends_the_text_before_it(engine: Engine) -> None:
    """With a stop string vLLM detokenises: the text ends just before the string, reason "stop"."""
    free = (await settle(engine.generate(PROMPTS[:1], n=1, temperature=0.0, max_tokens=MAX_TOKENS)))[0][0]
    stop = free.text[2]
    greedy = dict(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    stopped = (await settle(engine.generate(PROMPTS[:1], stop=[stop], **greedy)))[0][0]
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stopped.finish_reason == "stop"
    assert stopped.logprobs.shape == stopped.token_ids.shape


async def test_stop_token_ids_end_a_completion_at_the_first_one_and_finish_reasons_say_why(
    engine: Engine, tiny_model_dir: Path
) -> None:
    """Digits as stop tokens: a "stop" completion ends at its only stop token (kept, with its
    logprob); a "length" one has max_tokens tokens and no stop token."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    groups = await settle(
        engine.generate(PROMPTS[:2], n=8, temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=digits, seed=3)
    )
    reasons = {"stop": 0, "length": 0}
    for c in _flat(groups):
        ids = c.token_ids.tolist()
        stops_at = [i for i, t in enumerate(ids) if t in digits]
        reasons[c.finish_reason] += 1
        assert c.logprobs.shape == c.token_ids.shape
        if c.finish_reason == "length":
            assert len(ids) == MAX_TOKENS and not stops_at
        else:  # ended by the EOS (no stop token before it) or by its first stop token
            assert stops_at == ([] if ids[-1] == tokenizer.eos_token_id else [len(ids) - 1])
    assert reasons["stop"] > 0


async def test_prompt_longer_than_the_model_fails_the_call_and_the_engine_keeps_working(engine: Engine) -> None:
    """One over-long prompt fails the whole call with vLLM's message; the next call works."""
    with pytest.raises(Exception, match="maximum context length is 512"):
        await settle(engine.generate(["1+1=", "1" * 600], n=2, temperature=1.0, max_tokens=4))
    groups = await settle(engine.generate(["1+1="], n=2, temperature=1.0, max_tokens=4))
    assert [len(g) for g in groups] == [2]


# ------------------------------------------------------------------ the two modes together
async def test_async_mode_samples_what_batched_mode_samples(
    batched_engine: VllmEngine, async_engine: AsyncVllmEngine
) -> None:
    """With the same seed, one request per prompt gives the batched call's samples and logprobs."""
    batched = _flat(batched_engine.generate(PROMPTS, n=4, temperature=0.7, max_tokens=MAX_TOKENS, seed=5))
    concurrent = _flat(await async_engine.generate(PROMPTS, n=4, temperature=0.7, max_tokens=MAX_TOKENS, seed=5))
    assert len(batched) == len(concurrent) == 4 * len(PROMPTS)
    for b, a in zip(batched, concurrent):
        assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.token_ids, b.token_ids)
        assert_close_to_scale(a.logprobs, b.logprobs, rel=1e-5, scale=1.0, what="async vs batched logprobs")
        assert (a.text, a.finish_reason, a.policy_version) == (b.text, b.finish_reason, b.policy_version)


async def test_async_update_waits_for_generate_in_flight(
    async_engine: AsyncVllmEngine, tiny_model_dir: Path, tiny_model_dir_alt: Path
) -> None:
    """A generate already running finishes on the old weights and version; the next uses the new."""
    old = await _greedy(async_engine)
    running = asyncio.create_task(async_engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=MAX_TOKENS))
    await asyncio.sleep(0)  # the call registers and submits its requests
    try:
        await async_engine.update_weights(load_file(str(tiny_model_dir_alt / "model.safetensors")), version=1)
        groups = await running
        assert [g[0].token_ids.tolist() for g in groups] == old
        assert all(g[0].policy_version == 0 for g in groups)
        new = await async_engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
        assert all(g[0].policy_version == 1 for g in new)
        assert [g[0].token_ids.tolist() for g in new] != old
    finally:
        await async_engine.update_weights(load_file(str(tiny_model_dir / "model.safetensors")), version=0)


# ------------------------------------------------------------------ the Policy service
@pytest.mark.slow  # ~35 s; the engine-level tests above run async mode by default
async def test_policy_service_in_async_mode_generates_groups_and_updates_weights(
    tiny_model_dir: Path, tiny_model_dir_alt: Path
) -> None:
    """engine_mode="async" behind the service: a Group per caller, tagged with the loaded version."""
    from forge.actors.policy import Policy, PolicyConfig, prompt_key
    from forge.types import Prompt

    config = PolicyConfig(
        model_path=str(tiny_model_dir), group_size=3, max_tokens=4, max_model_len=64, engine_mode="async"
    )
    policy = await Policy.options(
        env={"OMP_NUM_THREADS": "1"}, endpoint_routers={"generate": "key_affinity"}
    ).as_service(config)
    try:
        prompts = [Prompt(prompt_id=str(i), text=f"{i}{i}=", answer="") for i in range(6)]
        groups = await asyncio.gather(*(policy.generate.route(p, key=prompt_key(p)) for p in prompts))
        assert [g.prompt.text for g in groups] == [p.text for p in prompts]
        assert all(len(g.completions) == 3 and g.policy_version == 0 for g in groups)
        weights = str(tiny_model_dir_alt / "model.safetensors")
        assert await policy.update_weights.fanout(weights, 1) == [1]
        group = await policy.generate.route(prompts[0], key=prompt_key(prompts[0]))
        assert group.policy_version == 1
    finally:
        await policy.shutdown()


async def _update_mid_generation(
    engine: VllmEngine, weights: dict[str, torch.Tensor], after_steps: int, keep_kv: bool
) -> list[Completion]:
    """Sample 4 prompts x 4 on version 0 with ``generate_async``; after ``after_steps`` engine
    steps, another task loads ``weights`` as version 1 while the sequences are in flight."""
    clock, start = engine.steps.clock, engine.steps.clock.steps

    async def update() -> None:
        while clock.steps - start < after_steps:
            await asyncio.sleep(0)  # runs between two engine steps
        engine.update_weights(weights, 1, keep_kv=keep_kv)

    groups, _ = await asyncio.wait_for(
        asyncio.gather(engine.generate_async(PROMPTS[:4], n=4, temperature=1.0, max_tokens=40, seed=3), update()),
        120,
    )
    return _flat(groups)


@pytest.mark.parametrize("keep_kv", [False, True])
async def test_a_sequence_in_flight_continues_on_new_weights_with_each_tokens_version_and_logprob(
    batched_engine: VllmEngine,
    hf_model: torch.nn.Module,
    hf_model_alt: torch.nn.Module,
    tiny_model_dir: Path,
    tiny_model_dir_alt: Path,
    keep_kv: bool,
) -> None:
    """An update between two engine steps: every sequence started on version 0 goes on with
    version 1's weights. Its first tokens are version 0's (logprobs of the seed-0 model), the rest
    version 1's; without keep_kv their logprobs are the seed-1 model's on the whole prefix (the KV
    was recomputed); with keep_kv they are not (the prefix's KV is the old weights')."""
    after = 5
    try:
        flat = await _update_mid_generation(
            batched_engine, load_file(str(tiny_model_dir_alt / "model.safetensors")), after, keep_kv
        )
    finally:
        batched_engine.update_weights(load_file(str(tiny_model_dir / "model.safetensors")), 0)
    spanning = [c for c in flat if c.token_ids.numel() > after]
    assert len(spanning) >= 4, [c.token_ids.numel() for c in flat]  # the update landed mid-sequence
    for c in flat:
        n = c.token_ids.numel()
        assert c.token_versions.tolist() == [0] * min(n, after) + [1] * max(n - after, 0), c.token_versions
        assert c.policy_version == (0 if n else 1)
    old = sequence_logprobs(hf_model, [c.prompt_ids for c in spanning], [c.token_ids for c in spanning])
    new = sequence_logprobs(hf_model_alt, [c.prompt_ids for c in spanning], [c.token_ids for c in spanning])
    got = torch.cat([c.logprobs[:after] for c in spanning])
    assert_close_to_scale(got, torch.cat([o[:after] for o in old]), rel=1e-3, scale=1.0, what="tokens before")
    got, want = torch.cat([c.logprobs[after:] for c in spanning]), torch.cat([w[after:] for w in new])
    if keep_kv:
        assert float((got - want).abs().max()) > 1e-2, "kept KV of the old weights changed nothing"
    else:
        assert_close_to_scale(got, want, rel=1e-3, scale=1.0, what="tokens after the update")
    # Neither version's logprobs fit the whole sequence: it really spans both.
    assert float((torch.cat([c.logprobs for c in spanning]) - torch.cat(old)).abs().max()) > 1e-2


async def test_a_batch_added_mid_generation_joins_the_running_one(batched_engine: VllmEngine) -> None:
    """Two generate_async calls, the second made while the first runs: each gets its own prompts'
    samples (greedy: what generate alone gives), and the engine ran them side by side, in fewer
    steps than the two would take one after the other."""
    steps = batched_engine.steps
    alone = [
        [c.token_ids.tolist() for c in g]
        for g in batched_engine.generate(PROMPTS[:4], n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    ]
    start = steps.clock.steps

    async def later() -> list[list[Completion]]:
        while steps.clock.steps - start < 2:
            await asyncio.sleep(0)
        return await batched_engine.generate_async(PROMPTS[2:4], n=1, temperature=0.0, max_tokens=MAX_TOKENS)

    first, second = await asyncio.gather(
        batched_engine.generate_async(PROMPTS[:2], n=1, temperature=0.0, max_tokens=MAX_TOKENS), later()
    )
    assert [[c.token_ids.tolist() for c in g] for g in first + second] == alone
    longest, ran = max(len(t) for g in alone for t in g), steps.clock.steps - start
    assert ran < longest + 4, (ran, longest)
    assert not steps.busy


@pytest.mark.parametrize("weight_updates", ["drain", "in_flight"])
async def test_a_policy_replica_takes_an_update_while_it_generates_as_its_mode_says(
    tiny_model_dir: Path, tiny_model_dir_alt: Path, weight_updates: str
) -> None:
    """An update reaches a replica in the middle of a batch. ``drain``: it waits, every token of
    the batch is version 0's, and a call arriving meanwhile is held until the update loaded (all
    version 1); ``in_flight``: it lands at once, and sequences still running go on with version
    1's tokens (versions never go back; a completion's version is its oldest token's). The
    replica's own step times give the update's stall and hold: a drain holds new work through the
    batch's tail, an update in flight only for its load."""
    from forge.actors.policy import Policy, PolicyConfig
    from forge.types import Prompt

    config = PolicyConfig(
        model_path=str(tiny_model_dir), group_size=4, max_tokens=200, max_model_len=256, weight_updates=weight_updates
    )
    policy = await Policy.options(env={"OMP_NUM_THREADS": "1"}).as_service(config)
    try:
        prompts = [Prompt(prompt_id=str(i), text=f"{i}{i}=", answer="") for i in range(8)]
        pending = [asyncio.ensure_future(policy.generate.route(p)) for p in prompts]
        for _ in range(3000):  # until the batch is generating (10 ms polls, 30 s at most)
            if (await policy.in_flight.fanout()) != [0]:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the batch never started")
        await policy.drain_metrics.fanout()  # only this update's records from here on
        update = asyncio.ensure_future(policy.update_weights.fanout(str(tiny_model_dir_alt / "model.safetensors"), 1))
        await asyncio.sleep(0.2)  # the update has reached the replica; the batch is still running
        late = asyncio.ensure_future(policy.generate.route(prompts[1]))
        assert await asyncio.wait_for(update, 120) == [1]
        groups = await asyncio.wait_for(asyncio.gather(*pending), 120)
        late_versions = (await asyncio.wait_for(late, 120)).token_versions.unique().tolist()
        completions = [c for g in groups for c in g.completions]
        versions = [c.token_versions.tolist() for c in completions]
        assert all(v == sorted(v) and set(v) <= {0, 1} for v in versions), versions
        assert all(c.policy_version == (min(v) if v else c.policy_version) for c, v in zip(completions, versions))
        spanning = [v for v in versions if len(set(v)) == 2]
        assert max(len(v) for v in versions) > 100, "the batch ended before the update: nothing tested"
        assert (await policy.generate.route(prompts[0])).token_versions.unique().tolist() == [1]
        records = [r for replica in await policy.drain_metrics.fanout() for r in replica]
        stall = {k: sum(v for n, v, _ in records if n == f"policy/update_{k}") for k in ("stall_s", "hold_s", "stalls")}
        assert stall["stalls"] == 1, records
        assert 0 < stall["stall_s"] < 5, stall
        if weight_updates == "drain":
            assert all(set(v) <= {0} for v in versions), versions
            assert late_versions == [1]  # held while the update waited, not joined to the batch on 0
            assert stall["hold_s"] > stall["stall_s"] + 0.1, stall  # the tail ran with new work held
        else:
            assert spanning, [len(v) for v in versions]
            assert late_versions == [1]  # the update loaded at once
            assert stall["hold_s"] == pytest.approx(stall["stall_s"], abs=0.05), stall
    finally:
        await policy.shutdown()


async def test_a_watched_request_shows_each_samples_tokens_as_they_come_and_they_add_up_to_its_result(
    batched_engine: VllmEngine,
) -> None:
    """The watcher of a streamed prompt sees its tokens grow step by step (more than one look
    before the end), always a prefix of what the call returns, with the same logprobs."""
    seen: dict[int, list[tuple[list[int], list[float]]]] = {0: [], 1: []}

    def watch(index: int, token_ids, logprobs, tops) -> None:
        seen[index].append((list(token_ids), list(logprobs)))

    (group, other) = await batched_engine.generate_async(
        PROMPTS[:2], n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=[3, 4], watchers=[watch, None]
    )
    for index, completion in enumerate(group):
        final_ids, final_lps = completion.token_ids.tolist(), completion.logprobs.tolist()
        looks = seen[index]
        assert len(looks) >= 2 or len(final_ids) <= 2, (index, looks)
        lengths = [len(ids) for ids, _ in looks]
        assert lengths == sorted(lengths) and lengths[-1] <= len(final_ids)
        for ids, lps in looks:
            assert ids == final_ids[: len(ids)] and lps == pytest.approx(final_lps[: len(lps)], abs=0)
    assert len(other) == 2


async def test_a_cancelled_request_ends_at_once_with_its_tokens_so_far_and_the_rest_of_its_call_goes_on(
    batched_engine: VllmEngine,
) -> None:
    """Cancelled by its tag after a few steps, a prompt's samples finish as "abort" with the tokens
    they had (a prefix of the uncancelled samples of the same seed), while the other prompt of the
    call runs to its end exactly as alone; the engine holds nothing after, and counts what it did."""
    steps = batched_engine.steps
    long = 200
    alone = batched_engine.generate(PROMPTS[:2], n=1, temperature=1.0, max_tokens=long, seed=[5, 6])
    before = dataclasses.replace(steps.counters)
    start = steps.clock.steps

    async def cancel_soon() -> bool:
        while steps.clock.steps - start < 4:
            await asyncio.sleep(0)
        return batched_engine.cancel("tagged")

    (cut, kept), cancelled = await asyncio.gather(
        batched_engine.generate_async(
            PROMPTS[:2], n=1, temperature=1.0, max_tokens=long, seed=[5, 6], tags=["tagged", None]
        ),
        cancel_soon(),
    )
    assert cancelled and not batched_engine.cancel("tagged")  # gone once done
    (cut,), (kept,) = cut, kept
    full_cut = alone[0][0].token_ids.tolist()
    assert cut.finish_reason == "abort" and 1 <= cut.token_ids.numel() < len(full_cut)
    assert cut.token_ids.tolist() == full_cut[: cut.token_ids.numel()]
    assert cut.logprobs.numel() == cut.token_ids.numel()
    assert kept.token_ids.tolist() == alone[1][0].token_ids.tolist() and kept.finish_reason != "abort"
    assert not steps.busy and not batched_engine.llm.llm_engine.has_unfinished_requests()  # vLLM dropped it
    after = steps.counters
    assert after.cancelled == before.cancelled + 1 and after.requests == before.requests + 2
    assert after.generated_tokens - before.generated_tokens == cut.token_ids.numel() + kept.token_ids.numel()
    assert after.prompt_tokens - before.prompt_tokens == sum(len(g[0].prompt_ids) for g in alone)


async def test_a_repeated_prompt_is_counted_as_cached_prompt_tokens(batched_engine: VllmEngine) -> None:
    """The long prompt twice in a row: the second time its full blocks come from the prefix cache,
    and the counters say so (computed prompt tokens fall by at least a block)."""
    steps = batched_engine.steps
    prompt = "9*9=" * 40  # 160 tokens: several full KV blocks
    before = dataclasses.replace(steps.counters)
    batched_engine.generate([prompt], n=1, temperature=0.0, max_tokens=2)
    first = dataclasses.replace(steps.counters)
    batched_engine.generate([prompt], n=1, temperature=0.0, max_tokens=2)
    second = steps.counters
    computed_first = first.computed_prompt_tokens - before.computed_prompt_tokens
    computed_second = second.computed_prompt_tokens - first.computed_prompt_tokens
    assert second.cached_prompt_tokens - first.cached_prompt_tokens >= 32
    assert computed_second <= computed_first - 32, (computed_first, computed_second)


async def test_top_logprobs_give_each_positions_most_likely_tokens_and_leave_the_samples_as_they_were(
    batched_engine: VllmEngine,
) -> None:
    """``top_logprobs=3``: per token, three (token, logprob) pairs in falling order; the samples and
    their logprobs are those of the same call without them; greedy, the sampled token is the top one."""
    plain = batched_engine.generate(PROMPTS[:2], n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=[1, 2])
    topped = batched_engine.generate(
        PROMPTS[:2], n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=[1, 2], top_logprobs=3
    )
    for a, b in zip(_flat(plain), _flat(topped)):
        assert a.top_logprobs is None and a.token_ids.tolist() == b.token_ids.tolist()
        assert b.logprobs.tolist() == pytest.approx(a.logprobs.tolist(), abs=1e-6)
        assert len(b.top_logprobs) == b.token_ids.numel()
        for sampled_lp, top in zip(b.logprobs.tolist(), b.top_logprobs):
            values = [lp for _, lp in top]
            assert len(top) == 3 and values == sorted(values, reverse=True) and sampled_lp <= values[0] + 1e-6
    (greedy,) = batched_engine.generate(PROMPTS[:1], n=1, temperature=0.0, max_tokens=MAX_TOKENS, top_logprobs=2)
    for token, top in zip(greedy[0].token_ids.tolist(), greedy[0].top_logprobs):
        assert top[0][0] == token
    with pytest.raises(ValueError, match="top_logprobs must be an int in 0..20, got 21"):
        batched_engine.generate(PROMPTS[:1], n=1, temperature=1.0, max_tokens=2, top_logprobs=21)
