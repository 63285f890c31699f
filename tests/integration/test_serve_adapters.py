"""Several models behind one front door: LoRA adapters (``policy.adapters``) beside the base.

One server for the module, on the tiny chat model and two adapters of random weights written as
PEFT folders: ``/v1/models`` lists the three, a request's ``model`` picks the weights that
sample it (the served logprobs are PEFT's for that adapter, the base's for the base), streamed
or not, and a model the server does not serve is a 404 naming those it does.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from apps.common.inputs import make_model  # noqa: E402
from apps.serve.cli import serve_command, served_url  # noqa: E402
from apps.serve.config import ServeConfig  # noqa: E402
from forge.config import load_config  # noqa: E402
from forge.models import sequence_logprobs  # noqa: E402
from forge.models.lora import LoraSettings, random_adapter, write_adapter_folder  # noqa: E402
from tests.numerics import assert_close_to_scale  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)
SETTINGS = LoraSettings(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"])
ADAPTERS = {"adder": 1, "other": 2}  # model id -> the seed of its random weights


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, torch.nn.Module]]]:
    """The base URL, and the transformers model behind each model id (PEFT's for the adapters)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("serve-adapters")
    cfg = load_config(ServeConfig, "configs/serve_tiny.yaml", [f"model.path={folder / 'model'}"])
    base_dir = str(make_model(cfg.model))
    models = {"tiny": AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()}
    overrides = []
    for name, seed in ADAPTERS.items():
        models[name], tensors = random_adapter(base_dir, SETTINGS, seed, scale=0.3)
        write_adapter_folder(folder / name, tensors, SETTINGS, base_dir)
        overrides.append(f"policy.adapters.{name}={folder / name}")
    cmd = serve_command(folder, *overrides, "policy.adapters_per_replica=1")  # the two share one vLLM slot
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = served_url(proc)
    if url is None:
        proc.kill()
        pytest.fail(f"the server did not start: {proc.stderr.read()[-3000:]}")
    yield url, models
    proc.terminate()
    assert proc.wait(60) == 143, proc.stderr.read()[-3000:]


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)


async def test_models_lists_the_base_and_its_adapters(served) -> None:
    url, _ = served
    cards = (await _client(url).models.list()).data
    assert [c.id for c in cards] == ["tiny", "adder", "other"]
    assert [c.model_extra.get("parent") for c in cards] == [None, "tiny", "tiny"]


async def test_each_model_id_samples_with_its_own_weights(served) -> None:
    """Per model: the served behaviour logprobs of its samples are what transformers (PEFT for an
    adapter) gives those tokens, and far from what the base gives them. Asked in turns, so the
    two adapters take turns in the replica's one vLLM slot (evicted and loaded again)."""
    url, models = served
    client = _client(url)
    for _ in range(2):
        for name in ("adder", "tiny", "other"):
            done = await client.completions.create(
                model=name, prompt="371=", n=4, max_tokens=8, seed=3, logprobs=1, extra_body={"return_token_ids": True}
            )
            assert done.model == name
            prompt = torch.tensor(done.model_extra["prompt_token_ids"])
            tokens = [torch.tensor(c.model_extra["token_ids"]) for c in done.choices]
            got = torch.cat([torch.tensor(c.logprobs.token_logprobs) for c in done.choices])
            want = torch.cat(sequence_logprobs(models[name], [prompt] * len(tokens), tokens, 1.0))
            assert_close_to_scale(got, want, rel=1e-3, scale=1.0, what=f"{name}'s served logprobs")
            if name != "tiny":
                base = torch.cat(sequence_logprobs(models["tiny"], [prompt] * len(tokens), tokens, 1.0))
                assert (got - base).abs().max() > 1e-2, f"{name} was sampled by the base"
    import httpx

    async with httpx.AsyncClient() as http:
        text = (await http.get(url.removesuffix("/v1") + "/metrics")).text
    evictions = re.search(r'^forge_model_evictions_total\{replica="0"\} (\S+)$', text, re.M)
    assert evictions and float(evictions.group(1)) >= 3, text  # adder, other, adder, other through one slot


async def test_an_adapter_streams_and_an_unknown_model_is_a_404_naming_the_served_ones(served) -> None:
    url, _ = served
    client = _client(url)
    args = {"model": "adder", "messages": [{"role": "user", "content": "12="}], "max_tokens": 8, "seed": 4}
    whole = await client.chat.completions.create(**args)
    streamed = [c async for c in await client.chat.completions.create(**args, stream=True)]
    text = "".join(choice.delta.content or "" for chunk in streamed for choice in chunk.choices)
    assert text == whole.choices[0].message.content and {c.model for c in streamed} == {"adder"}
    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="missing", prompt="1=", max_tokens=2)
    assert "['tiny', 'adder', 'other']" in caught.value.body["message"]
