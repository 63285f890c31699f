"""The OpenAI front door (``python -m apps.serve.main``) against the real ``openai`` client on loopback.

One server for the module: the tiny chat model (``configs/serve_tiny.yaml``) on two policy
replicas, an API key, a free port. Completions and chat through ``openai.AsyncOpenAI``, streamed
and not, the token-level extensions, the replica header of a session, ``/metrics``, clients that
disconnect, bad input in OpenAI's error shape, a wrong key, 1,000 requests from 64 concurrent
clients with nothing lost, and a replica killed under load (streams included).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from apps.serve.cli import serve_command, served_url  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "test-key"
pytestmark = pytest.mark.timeout(300)


SERVER_PID: list[int] = []
STREAMS = 16
"""Streams under way when a replica is killed: some (all but surely) on the one killed."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a running server; stopped with SIGTERM at the end, which it must take as
    every app does: the replicas stopped, exit 143."""
    folder = tmp_path_factory.mktemp("serve")
    cmd = serve_command(folder, f"server.api_key={KEY}", "policy.num_replicas=2")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    SERVER_PID[:] = [proc.pid]
    url = served_url(proc)
    if url is None:
        proc.kill()
        pytest.fail(f"the server did not start: {proc.stderr.read()[-3000:]}")
    yield url
    proc.terminate()
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the server did not stop within 60 s of SIGTERM")
    err = proc.stderr.read()
    assert code == 143 and "terminated (SIGTERM); every role was stopped" in err, err[-3000:]


def _client(url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


async def test_models_completions_and_chat_with_token_ids_logprobs_and_versions(server: str) -> None:
    client = _client(server)
    assert [m.id for m in (await client.models.list()).data] == ["tiny"]

    done = await client.completions.create(
        model="tiny", prompt="371=", n=3, max_tokens=6, logprobs=1, extra_body={"return_token_ids": True}
    )
    assert len(done.choices) == 3
    extra = done.model_extra
    assert extra["prompt_token_ids"] and done.usage.prompt_tokens == len(extra["prompt_token_ids"])
    total = 0
    for choice in done.choices:
        ids = choice.model_extra["token_ids"]
        assert len(ids) == len(choice.logprobs.token_logprobs) <= 6 and choice.model_extra["policy_version"] == 0
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert "".join(choice.logprobs.tokens) == choice.text
        total += len(ids)
    assert done.usage.completion_tokens == total

    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "371="}], max_tokens=5, logprobs=True
    )
    (choice,) = chat.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert len(choice.logprobs.content) == chat.usage.completion_tokens <= 5
    # The chat template wraps the message: more prompt tokens than the four characters.
    assert chat.usage.prompt_tokens > 4


async def test_a_four_turn_session_keeps_the_models_own_tokens_and_a_rewritten_history_starts_afresh(
    server: str,
) -> None:
    """Each turn of an ``X-Session-ID`` chat is sampled from the last turn's prompt ids and sampled
    ids exactly, then the template's added text; one whose history was rewritten is tokenised whole."""
    client = _client(server).with_options(default_headers={"X-Session-ID": "four-turns"})
    messages = [{"role": "user", "content": "371="}]
    history: list[int] = []
    for turn in range(4):
        reply = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, extra_body={"return_token_ids": True}
        )
        prompt_ids, (choice,) = reply.model_extra["prompt_token_ids"], reply.choices
        assert prompt_ids[: len(history)] == history, f"turn {turn} re-encoded the history"
        assert len(prompt_ids) > len(history)
        history = prompt_ids + choice.model_extra["token_ids"]
        messages += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "x="}]
    # The same session, the first reply rewritten: not a continuation, so the text is tokenised whole.
    messages[1] = {"role": "assistant", "content": "rewritten"}
    reply = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, extra_body={"return_token_ids": True}
    )
    assert reply.model_extra["prompt_token_ids"][: len(history)] != history


async def test_a_seed_gives_the_same_samples_and_stop_strings_end_the_text(server: str) -> None:
    client = _client(server)
    first, second = await asyncio.gather(
        *(client.completions.create(model="tiny", prompt="12=", n=2, max_tokens=8, seed=7) for _ in range(2))
    )
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    text = first.choices[0].text
    if len(text) > 2:  # stop at the third character: the text ends before it
        stopped = await client.completions.create(model="tiny", prompt="12=", n=2, max_tokens=8, seed=7, stop=[text[2]])
        assert not stopped.choices[0].text.endswith(text[2]) and text.startswith(stopped.choices[0].text)


async def _metrics(url: str) -> dict[str, float]:
    """``/metrics`` as ``{name{labels}: value}`` (and each family's total under its bare name)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient() as http:
        answer = await http.get(url.removesuffix("/v1") + "/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def test_a_streamed_completion_comes_in_pieces_that_add_up_to_the_unstreamed_answer(server: str) -> None:
    """Same seed, streamed and not: each choice's text, token ids and finish reason are the same;
    the text came in several events (not all at the end), and usage comes last when asked."""
    client = _client(server)
    args = {"model": "tiny", "prompt": "371=", "n": 2, "max_tokens": 16, "seed": 11}
    whole = await client.completions.create(**args, extra_body={"return_token_ids": True})
    texts, ids, finish, pieces, versions = ["", ""], [[], []], [None, None], [0, 0], [None, None]
    usage = None
    stream = await client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True}
    )
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            pieces[choice.index] += bool(choice.text)
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
                versions[choice.index] = choice.model_extra["policy_version"]
                ids[choice.index] = choice.model_extra["token_ids"]
    assert texts == [c.text for c in whole.choices]
    assert ids == [c.model_extra["token_ids"] for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices] and versions == [0, 0]
    for text, n in zip(texts, pieces):
        assert n >= min(2, len(text)), (texts, pieces)
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


async def test_a_streamed_chat_starts_with_the_role_and_its_pieces_carry_their_logprobs(server: str) -> None:
    client = _client(server)
    args = {"model": "tiny", "messages": [{"role": "user", "content": "12="}], "max_tokens": 10, "seed": 5}
    whole = await client.chat.completions.create(**args, logprobs=True)
    chunks = [c async for c in await client.chat.completions.create(**args, logprobs=True, stream=True)]
    deltas = [choice for chunk in chunks for choice in chunk.choices]
    assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == whole.choices[0].finish_reason
    assert "".join(d.delta.content or "" for d in deltas) == whole.choices[0].message.content
    streamed = [lp.logprob for d in deltas if d.logprobs and d.logprobs.content for lp in d.logprobs.content]
    assert streamed == pytest.approx([lp.logprob for lp in whole.choices[0].logprobs.content], abs=0)


async def test_top_logprobs_list_the_most_likely_tokens_streamed_or_not(server: str) -> None:
    """Chat ``top_logprobs=3`` (greedy: the sampled token is the first of them) and completions
    ``logprobs=2``; the streamed chat carries the same alternatives as the whole answer."""
    client = _client(server)
    args = {"model": "tiny", "messages": [{"role": "user", "content": "7="}], "max_tokens": 6, "temperature": 0}
    whole = await client.chat.completions.create(**args, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 for t in content)
    for token in content:
        assert token.top_logprobs[0].token == token.token and token.top_logprobs[0].logprob == token.logprob
        values = [t.logprob for t in token.top_logprobs]
        assert values == sorted(values, reverse=True)
    chunks = [c async for c in await client.chat.completions.create(**args, logprobs=True, top_logprobs=3, stream=True)]
    streamed = [
        t for c in chunks for ch in c.choices if ch.logprobs and ch.logprobs.content for t in ch.logprobs.content
    ]
    assert [[a.token for a in t.top_logprobs] for t in streamed] == [[a.token for a in t.top_logprobs] for t in content]
    done = await client.completions.create(model="tiny", prompt="7=", max_tokens=4, logprobs=2, seed=1)
    tops = done.choices[0].logprobs.top_logprobs
    assert len(tops) == len(done.choices[0].logprobs.tokens) and all(len(t) == 2 for t in tops)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(**args, logprobs=True, top_logprobs=21)
    assert caught.value.body["param"] == "top_logprobs"


async def test_a_streamed_text_never_shows_a_stop_string_it_ends_at(server: str) -> None:
    client = _client(server)
    for seed in range(7, 17):  # a sample long enough to stop inside (nearly every one is)
        args = {"model": "tiny", "prompt": "12=", "max_tokens": 16, "seed": seed}
        text = (await client.completions.create(**args)).choices[0].text
        if len(text) >= 4:
            break
    assert len(text) >= 4, f"ten samples all shorter than 4 characters, the last {text!r}"
    stop = text[2:4]  # two characters: the first of them is streamed before the second says it stops
    whole = (await client.completions.create(**args, stop=[stop])).choices[0].text
    streamed = "".join(
        [
            c.choices[0].text
            async for c in await client.completions.create(**args, stop=[stop], stream=True)
            if c.choices
        ]
    )
    assert streamed == whole and stop not in streamed


async def test_every_turn_of_a_session_is_served_by_one_replica_and_the_response_names_it(server: str) -> None:
    client = _client(server).with_options(default_headers={"X-Session-ID": "named-replica"})
    messages = [{"role": "user", "content": "5="}]
    replicas = set()
    for _ in range(4):
        raw = await client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=3)
        replicas.add(raw.headers.get("x-forge-replica"))
        reply = raw.parse()
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "6="},
        ]
    (replica,) = replicas
    assert replica in {"0", "1"}
    streamed = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=3, stream=True
    )
    assert streamed.headers.get("x-forge-replica") == replica
    async for _ in streamed.parse():
        pass


async def test_metrics_count_requests_per_replica_prefix_cache_hits_and_responses_by_status(server: str) -> None:
    """After a 3-turn session (each turn's prefix is in its replica's cache) and a bad request:
    the replicas' requests and engine counters, cached prompt tokens, and the 200s and the 400."""
    client = _client(server).with_options(default_headers={"X-Session-ID": "metrics"})
    before = await _metrics(server)
    messages = [{"role": "user", "content": "1+2=" * 10}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "3="},
        ]
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="tiny", prompt="1=", max_tokens=0)
    after = await _metrics(server)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("forge_requests_total") >= 3 and grew("forge_engine_requests_total") >= 3
    assert grew("forge_engine_cached_prompt_tokens_total") >= 32  # turns 2 and 3 reuse turn 1's blocks
    assert grew("forge_engine_computed_prompt_tokens_total") < grew("forge_engine_prompt_tokens_total")
    assert grew("forge_http_responses_total{status=200}") >= 3 and grew("forge_http_responses_total{status=400}") == 1
    assert after["forge_replica_up"] == 2 and grew("forge_http_completion_tokens_total") >= 3


async def test_a_client_that_disconnects_cancels_its_request_on_the_replica(server: str) -> None:
    """A stream closed after its first event, and a long request whose client gives up: both are
    cancelled on their replica while they generate (``forge_engine_cancelled``), not run to the end."""
    import httpx

    before = await _metrics(server)
    body = {"model": "tiny", "prompt": "1=", "n": 8, "max_tokens": 250}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{server}/completions", json={**body, "stream": True}, headers=headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{server}/completions", json=body, headers=headers, timeout=0.25)

    async def cancelled() -> bool:
        after = await _metrics(server)
        return after["forge_engine_cancelled_total"] - before["forge_engine_cancelled_total"] >= 2

    deadline = time.monotonic() + 20
    while not await cancelled():
        assert time.monotonic() < deadline, "the replicas did not cancel the two abandoned requests within 20 s"
        await asyncio.sleep(0.2)
    after = await _metrics(server)
    assert after["forge_http_cancelled_total"] - before["forge_http_cancelled_total"] == 2
    closed = "forge_http_responses_total{status=499}"  # the one not streamed: nobody left to answer
    assert after.get(closed, 0) - before.get(closed, 0) == 1


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"model": "other"}, 404, "model"),
        ({"prompt": "1" * 300}, 400, "prompt"),
        ({"n": 0}, 400, "n"),
        ({"extra_body": {"temperature": "hot"}}, 400, "temperature"),
    ],
)
async def test_bad_input_is_a_4xx_in_openais_shape_naming_the_field(server: str, kwargs, status, param) -> None:
    client = _client(server)
    args = {"model": "tiny", "prompt": "1=", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as caught:
        await client.completions.create(**args)
    assert caught.value.status_code == status
    error = caught.value.body
    assert error["param"] == param and error["message"] and error["type"], error


async def test_a_wrong_or_missing_key_is_401(server: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        await _client(server, "wrong").completions.create(model="tiny", prompt="1=", max_tokens=2)
    import httpx

    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{server}/completions", json={"model": "tiny", "prompt": "1="})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"


def _clients(url: str, requests: int, concurrency: int, max_tokens: int, answers: dict[int, str]) -> list:
    """``concurrency`` clients taking ``requests`` prompts from one queue; each answer lands in ``answers``."""
    client = _client(url)
    queue = list(range(requests))

    async def worker() -> None:
        while queue:
            i = queue.pop()
            done = await client.completions.create(model="tiny", prompt=f"{i}=", max_tokens=max_tokens, seed=i)
            answers[i] = done.choices[0].text

    return [worker() for _ in range(concurrency)]


async def test_a_thousand_requests_from_64_concurrent_clients_all_come_back(server: str) -> None:
    answers: dict[int, str] = {}
    await asyncio.wait_for(asyncio.gather(*_clients(server, 1000, 64, 2, answers)), 240)
    assert sorted(answers) == list(range(1000))


async def test_a_replica_killed_under_load_loses_no_request_and_the_server_stays_up(server: str) -> None:
    """SIGKILL of one of the two policy replicas while 64 clients send 400 requests and 16 streams
    are under way: every request is answered (the service resends what the dead replica held),
    every stream ends, whole or (on the dead replica: a stream is never sent again, its client
    has part of the answer) with an error event, and the server still serves. Last in the
    module: the killed replica restarts in the background."""
    import httpx

    from apps.grpo.faults import role_processes

    client = _client(server)
    answers: dict[int, str] = {}
    streaming, streams = STREAMS, []

    async def kill_one() -> None:
        while len(answers) < 100 or len(streams) + streaming_now[0] < streaming:
            await asyncio.sleep(0.01)
        replicas = role_processes(SERVER_PID[0], "policy")
        assert len(replicas) == 2, replicas
        replicas[0].kill()

    streaming_now = [0]  # streams that have had their first event

    async def stream_one(i: int) -> None:
        first = True
        try:
            stream = await client.completions.create(model="tiny", prompt=f"s{i}=", max_tokens=250, stream=True)
            async for chunk in stream:
                if first:
                    streaming_now[0], first = streaming_now[0] + 1, False
                if chunk.choices and chunk.choices[0].finish_reason:
                    streams.append("whole")
        except openai.APIStatusError as exc:  # failed before its first event: an HTTP status
            streams.append(f"status {exc.status_code}")
        except openai.APIError as exc:  # an error event after the first
            streams.append(f"error event: {exc.message}")
        finally:
            streaming_now[0] -= not first

    async def streams_under_kill() -> None:
        while len(answers) < 50:
            await asyncio.sleep(0.01)
        await asyncio.gather(*(stream_one(i) for i in range(streaming)))

    await asyncio.wait_for(
        asyncio.gather(kill_one(), streams_under_kill(), *_clients(server, 400, 64, 16, answers)), 240
    )
    assert sorted(answers) == list(range(400))
    assert len(streams) == streaming and all(s == "whole" or "error event" in s for s in streams), streams
    assert any("error event" in s and "process" in s for s in streams), streams  # 2 ** -15 to miss by chance
    done = await client.completions.create(model="tiny", prompt="1=", max_tokens=2)
    assert done.choices
    async with httpx.AsyncClient() as http:
        assert (await http.get(server.removesuffix("/v1") + "/health")).status_code == 200
