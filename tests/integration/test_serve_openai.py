"""The OpenAI front door (``python -m apps.serve.main``) against the real ``openai`` client on loopback.

One server for the module: the tiny chat model (``configs/serve_tiny.yaml``) on two policy
replicas, an API key, a free port. Completions and chat through ``openai.AsyncOpenAI``, the
token-level extensions, bad input in OpenAI's error shape, a wrong key, and 1,000 requests from
64 concurrent clients with nothing lost.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from apps.serve.cli import serve_command  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "test-key"
pytestmark = pytest.mark.timeout(300)


SERVER_PID: list[int] = []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a running server; stopped with SIGTERM at the end, which it must take as
    every app does: the replicas stopped, exit 143."""
    folder = tmp_path_factory.mktemp("serve")
    cmd = serve_command(folder, f"server.api_key={KEY}", "policy.num_replicas=2")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    SERVER_PID[:] = [proc.pid]
    deadline = time.monotonic() + 180
    url = None
    while url is None:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start: {proc.stderr.read()[-3000:]}")
        found = re.search(r"serving 'tiny' at (http://\S+)", line)
        url = found.group(1) if found else None
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


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"model": "other"}, 404, "model"),
        ({"stream": True}, 400, "stream"),
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
    """SIGKILL of one of the two policy replicas while 64 clients send 400 requests: every request
    is answered (the service resends what the dead replica held), and the server still serves.
    Last in the module: the killed replica restarts in the background."""
    import httpx

    from apps.grpo.faults import role_processes

    client = _client(server)
    answers: dict[int, str] = {}

    async def kill_one() -> None:
        while len(answers) < 100:
            await asyncio.sleep(0.01)
        replicas = role_processes(SERVER_PID[0], "policy")
        assert len(replicas) == 2, replicas
        replicas[0].kill()

    await asyncio.wait_for(asyncio.gather(kill_one(), *_clients(server, 400, 64, 16, answers)), 240)
    assert sorted(answers) == list(range(400))
    done = await client.completions.create(model="tiny", prompt="1=", max_tokens=2)
    assert done.choices
    async with httpx.AsyncClient() as http:
        assert (await http.get(server.removesuffix("/v1") + "/health")).status_code == 200
