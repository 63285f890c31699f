"""``AsyncVllmEngine``: the policy's sampler on vLLM's ``AsyncLLM``, one request per prompt.

The other way to serve prebatched prompts (``VllmEngine`` makes one ``LLM.generate`` call per
batch): every prompt of a batch becomes its own ``AsyncLLM.generate`` request, all of them in
flight at once, and vLLM's scheduler batches whatever has arrived at each engine step. Same
inputs and outputs as ``VllmEngine`` (token ids, ``processed_logprobs`` behaviour logprobs,
version tag; with a ``seed``, the same samples), but every method is a coroutine.

How it differs underneath (figures in ``docs/benchmarks.md``, "Figures the code rests on"):

- ``AsyncLLM`` always runs the engine core (scheduler and model) in a child process; this
  process tokenises, turns outputs into results and talks to it over ZMQ. With forge's
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the model runs inside that child: 2 processes, not 3.
- Requests reach the engine one by one, so its first steps run on the part of the batch that
  has arrived: it takes more engine steps for a batch than one ``LLM.generate`` does. With the
  messaging, that made it slower than ``VllmEngine`` on the GRPO app's batches on CPU
  (``benchmarks/policy_engine.py``), so it is not the default. Holding the scheduler until a
  whole batch was queued (pause "keep", add, resume) matched ``LLM.generate``'s step count
  but barely helped: the per-request messaging, not the steps, is the gap.
- Weights cross to the child process as safetensors bytes. An update waits for the generate
  calls in flight to finish, and generate calls made meanwhile wait for the update, so every
  completion's version tag is exact.

Create it inside the event loop that will call it: ``AsyncLLM``'s output loop runs there.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from forge.generation.drain_gate import DrainGate
from forge.generation.vllm_engine import configure_vllm_env
from forge.generation.vllm_io import (
    Prompts,
    checked_weights,
    engine_args,
    local_model_dir,
    safetensors_blob,
    sampling_params,
    to_completions,
    token_prompts,
)
from forge.generation.weight_sync import checkpoint_spec, checkpoint_ties_embeddings
from forge.types import Completion

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["AsyncVllmEngine"]


class AsyncVllmEngine:
    """Concurrent per-prompt sampling with behaviour logprobs, and in-place weight updates.

    Build it with ``await AsyncVllmEngine.create(...)``. ``version`` is the policy version of
    the loaded weights (0 for the checkpoint); every ``Completion`` carries the version it was
    sampled with. Safe to call from many tasks of one event loop.
    """

    def __init__(
        self,
        engine: AsyncLLM,
        *,
        weight_spec: dict[str, tuple[int, ...]],
        tied_embeddings: bool,
    ) -> None:
        """Wrap a started ``AsyncLLM``; prefer ``AsyncVllmEngine.create``."""
        self._engine: AsyncLLM | None = engine
        self._tokenizer = engine.get_tokenizer()
        self._weight_spec = weight_spec
        self._tied = tied_embeddings
        self._version = 0
        self._request_ids = itertools.count()
        self._gate = DrainGate()  # an update waits for the generate calls in flight and holds new ones

    @classmethod
    async def create(
        cls,
        model_path: str | os.PathLike,
        *,
        max_model_len: int,
        seed: int,
        dtype: str = "float32",
        kv_cache_bytes: int = 64 << 20,
        enforce_eager: bool = True,
        **engine_kwargs: Any,
    ) -> AsyncVllmEngine:
        """Start ``AsyncLLM`` and its engine-core process on ``model_path``.

        Arguments as ``VllmEngine.create``; extra ``engine_kwargs`` go to ``AsyncEngineArgs``.
        """
        model_dir = local_model_dir(model_path)
        configure_vllm_env()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(model_dir, max_model_len, seed, dtype, kv_cache_bytes, enforce_eager, engine_kwargs)
        args.setdefault("disable_log_stats", True)  # as vllm.LLM: no throughput log every 10 s
        weight_spec = checkpoint_spec(model_dir)
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        try:
            await engine.collective_rpc("forge_apply_cpu_sampler_fix")
            return cls(
                engine,
                weight_spec=weight_spec,
                tied_embeddings=checkpoint_ties_embeddings(engine.model_config),
            )
        except BaseException:
            engine.shutdown()
            raise
        finally:
            # A module vLLM imports during this call keeps its import frames, and so this one,
            # alive; without the del this frame would hold the AsyncLLM until interpreter exit,
            # whose __del__ then fails (see ``shutdown``).
            del engine

    @property
    def version(self) -> int:
        """Policy version of the weights now loaded."""
        return self._version

    @property
    def engine(self) -> AsyncLLM:
        """The underlying ``AsyncLLM``, for what this class does not wrap."""
        if self._engine is None:
            raise RuntimeError("AsyncVllmEngine was shut down")
        return self._engine

    async def generate(
        self,
        prompts: Prompts,
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | list[int] | None = None,
    ) -> list[list[Completion]]:
        """Sample ``n`` completions per prompt, each prompt its own concurrent request.

        Arguments and result as ``VllmEngine.generate``. If one request fails, the others are
        cancelled (which aborts them in vLLM) and its error is raised.
        """
        params = sampling_params(len(prompts), n, temperature, max_tokens, top_p, stop, seed, stop_token_ids)
        if not prompts:
            return []
        inputs = token_prompts(prompts, self._tokenizer)
        per_prompt = params if isinstance(params, list) else [params] * len(inputs)
        async with self._gate.calling():  # waits while an update is loading
            version = self._version
            tasks = [asyncio.ensure_future(self._one(p, sp)) for p, sp in zip(inputs, per_prompt)]
            try:
                outputs = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)  # their aborts reach vLLM
                raise
        return to_completions(outputs, version, decode_with=None if stop else self._tokenizer)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights in place and record their policy ``version``.

        Validated first, as ``VllmEngine.update_weights``. Waits for the generate calls in
        flight to finish; calls made meanwhile start after the update, on the new weights.
        """
        weights = checked_weights(state_dict, version, self._weight_spec, self._tied)
        blob = safetensors_blob(weights)
        async with self._gate.draining():
            await self.engine.collective_rpc("forge_load_safetensors", args=(blob,))
            if not await self.engine.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
            self._version = version

    def shutdown(self) -> None:
        """Stop the engine-core process; safe to call twice."""
        if self._engine is None:
            return
        self._engine.shutdown()
        self._engine = None

    async def _one(self, prompt: Any, params: SamplingParams) -> RequestOutput:
        """One request through ``AsyncLLM.generate``; its final output (``FINAL_ONLY``)."""
        final = None
        async for out in self.engine.generate(prompt, params, request_id=f"forge-{next(self._request_ids)}"):
            final = out
        if final is None or not final.finished:
            raise RuntimeError("vLLM's AsyncLLM ended a request without a final output")
        return final
