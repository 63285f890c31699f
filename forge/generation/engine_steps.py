"""``EngineSteps``: an in-process vLLM engine driven one step at a time, each token's version known.

``vllm.LLM.generate`` adds its requests and steps the engine until they finish, and nothing else
can happen meanwhile. Driving the same loop here, an engine step at a time, does two things:

- **Weights can change between two steps** (``VllmEngine.update_weights`` from another task of
  the event loop, while ``generate_async`` yields after each step). A sequence then continues on
  the new weights; since a step is synchronous and an update runs only between steps, the
  tokens of every step were sampled with exactly one version.
- **Every sampled token carries that version.** Outputs stay ``FINAL_ONLY`` (no per-step
  output objects, so the loop costs what ``LLM.generate``'s does); at each update this records,
  per live sample, how many tokens it had (``mark``), and a finished sample's token versions are
  cut from those marks.

Concurrent callers share the engine: whoever steps it delivers every request's final output,
so a batch that arrives while another is generating joins the running one (vLLM batches them
at each step). Not thread-safe: one event loop, one thread.

A request may be **watched** (its caller streams it: after each step the watcher sees every
sample's tokens so far, read from vLLM's own request state, so outputs stay ``FINAL_ONLY``) and
**cancelled** by the tag its caller gave it (its client went away): it leaves the engine at once
and finishes with what it had, ``finish_reason`` "abort", so the call it was part of returns.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm import RequestOutput
    from vllm.v1.engine.llm_engine import LLMEngine

__all__ = ["EngineCounters", "EngineSteps", "SampleVersions", "StepClock", "StepWatcher", "UpdateStall"]

StepWatcher = Callable[[int, Sequence[int], Sequence[float], Sequence[Any] | None], None]
"""Called after an engine step with one sample's index, its token ids so far, their logprobs and
(when asked for) each position's top tokens."""


@dataclass
class EngineCounters:
    """What the engine has done since it started (sums; a reader takes differences)."""

    requests: int = 0
    """Requests finished (a request of ``n`` samples counts once)."""
    prompt_tokens: int = 0
    """Prompt tokens of those requests."""
    cached_prompt_tokens: int = 0
    """Of those, the ones vLLM found in its prefix cache (not computed again)."""
    generated_tokens: int = 0
    """Tokens sampled (every sample's)."""
    cancelled: int = 0
    """Requests cancelled before they finished (``EngineSteps.cancel``)."""

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens the engine computed (prefill): the prompt tokens the cache did not hold."""
        return self.prompt_tokens - self.cached_prompt_tokens


@dataclass
class SampleVersions:
    """When one sample's version changed: ``(tokens it had, the version after)``, in order."""

    start: int
    """The version when the request was added."""
    marks: list[tuple[int, int]] = field(default_factory=list)

    def per_token(self, num_tokens: int) -> torch.Tensor:
        """int64 ``[num_tokens]``: the version that sampled each token."""
        versions = torch.full((num_tokens,), self.start, dtype=torch.long)
        for tokens_before, version in self.marks:
            versions[tokens_before:] = version
        return versions

    def oldest(self, num_tokens: int) -> int:
        """The version of the first of ``num_tokens`` tokens (with none: the version now)."""
        version = self.start
        for tokens_before, later in self.marks:  # in order; tokens_before never decreases
            if num_tokens and tokens_before > 0:
                break
            version = later
        return version


@dataclass(frozen=True)
class UpdateStall:
    """What one weight update cost a replica, from the engine's own step times (seconds)."""

    stall_s: float
    """No token generated because of the update: from the later of the update's arrival and the
    last step before the load, to the first step after it (to the end of the load when no work
    was waiting then)."""
    hold_s: float
    """From the update's arrival to that first step: how long new work waited on it (a draining
    update holds new work while the sequences in flight finish)."""


class StepClock:
    """When one engine stepped: its busy seconds and what each weight update stalled it.

    An update opens a stall (``open``) as it starts loading; the next step's start closes it,
    or the load's end (``close_now``) when no work waits for a step. The caller takes what was
    measured (``take_busy_s``, ``take_stalls``) to record it as metrics.
    """

    def __init__(self) -> None:
        self.steps = 0
        """Engine steps run so far."""
        self.last_step_end: float | None = None
        self._busy_s = 0.0
        self._open: tuple[float, float] | None = None  # (stall from, arrived)
        self._stalls: list[UpdateStall] = []

    def open(self, arrived: float) -> None:
        """An update that arrived at ``arrived`` (``time.monotonic()``) starts loading now."""
        since = arrived if self.last_step_end is None else max(arrived, self.last_step_end)
        self._open = (since, arrived)

    def close_now(self) -> None:
        """The update has loaded and no work waits: the stall ends now, not at the next step."""
        self._close(time.monotonic())

    def stepping(self, start: float, end: float) -> None:
        """A step ran from ``start`` to ``end``."""
        self._close(start)
        self.steps += 1
        self._busy_s += end - start
        self.last_step_end = end

    def take_busy_s(self) -> float:
        """Seconds spent in engine steps since the last call."""
        busy, self._busy_s = self._busy_s, 0.0
        return busy

    def take_stalls(self) -> list[UpdateStall]:
        """The stalls closed since the last call."""
        stalls, self._stalls = self._stalls, []
        return stalls

    def _close(self, at: float) -> None:
        if self._open is not None:
            since, arrived = self._open
            self._stalls.append(UpdateStall(max(0.0, at - since), max(0.0, at - arrived)))
            self._open = None


class EngineSteps:
    """Adds requests to one in-process ``LLMEngine`` and steps it until they finish."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._ids = itertools.count()
        self._finished: dict[str, RequestOutput] = {}
        self._versions: dict[tuple[str, int], SampleVersions] = {}
        self._live: dict[str, int] = {}  # request id -> its samples (n)
        self._adapter_ids: dict[str, int] = {}  # request id -> the LoRA adapter it runs on (vLLM's id)
        self._watchers: dict[str, StepWatcher] = {}  # request id -> who sees its tokens after each step
        self._tagged: dict[Hashable, str] = {}  # the caller's tag -> request id (to cancel it by)
        self._tags: dict[str, Hashable] = {}
        self.counters = EngineCounters()
        """Requests, prompt tokens (and how many the prefix cache held), generated tokens, cancels."""
        self.clock = StepClock()
        """The engine's own step times (each step samples one token of every running sequence)."""

    @property
    def busy(self) -> bool:
        """Whether any request is in the engine (running or waiting)."""
        return bool(self._live)

    def add(
        self,
        inputs: Sequence[Any],
        params: Any,
        version: int,
        lora: Any = None,
        *,
        watchers: Sequence[StepWatcher | None] | None = None,
        tags: Sequence[Hashable | None] | None = None,
    ) -> list[str]:
        """Add one request per input (``params``: one ``SamplingParams`` or one per input); their ids.
        ``watchers``: one per input (or None), shown each sample's tokens after every step;
        ``tags``: one per input (or None), the name ``cancel`` takes (unique among live requests)."""
        per_input = params if isinstance(params, list) else [params] * len(inputs)
        watchers = watchers if watchers is not None else [None] * len(inputs)
        tags = tags if tags is not None else [None] * len(inputs)
        ids: list[str] = []
        try:
            for prompt, sampling, watcher, tag in zip(inputs, per_input, watchers, tags, strict=True):
                if tag is not None and tag in self._tagged:
                    raise ValueError(f"a request tagged {tag!r} is already in the engine; tags name one request")
                request_id = f"forge-{next(self._ids)}"
                self._engine.add_request(request_id, prompt, sampling, lora_request=lora)
                self._live[request_id] = sampling.n
                if watcher is not None:
                    self._watchers[request_id] = watcher
                if tag is not None:
                    self._tagged[tag], self._tags[request_id] = request_id, tag
                if lora is not None:
                    self._adapter_ids[request_id] = lora.lora_int_id
                for index in range(sampling.n):
                    self._versions[(request_id, index)] = SampleVersions(version)
                ids.append(request_id)
        except BaseException:  # e.g. a prompt longer than the model: none of the call's requests stays
            self.abort(ids)
            raise
        return ids

    def adapter_in_use(self, lora_int_id: int) -> bool:
        """Whether a request in the engine runs on the LoRA adapter ``lora_int_id``."""
        return lora_int_id in self._adapter_ids.values()

    def mark(self, version: int) -> None:
        """Every live sample's tokens from now on are ``version``'s (called by an update, between steps)."""
        counts = {
            (state.external_req_id, state.request_index): len(state.detokenizer.output_token_ids)
            for state in self._engine.output_processor.request_states.values()
        }
        for key, versions in self._versions.items():
            versions.marks.append((counts.get(key, 0), version))

    def step(self) -> None:
        """One engine step; the outputs of requests it finished are kept for their callers, and
        the watched requests' watchers see their tokens so far."""
        start = time.monotonic()
        for out in self._engine.step():
            if out.finished:
                self._finished[out.request_id] = out
        end = time.monotonic()
        self.clock.stepping(start, end)
        if self._watchers:
            self._show_progress()

    def cancel(self, tag: Hashable) -> bool:
        """End the live request tagged ``tag`` now: vLLM drops it, and it finishes with the tokens
        it had (``finish_reason`` "abort"). False if no unfinished request has that tag."""
        request_id = self._tagged.get(tag)
        if request_id is None or request_id in self._finished:
            return False
        self._finished[request_id] = self._partial_output(request_id)
        self._engine.abort_request([request_id])
        self.counters.cancelled += 1
        return True

    def _show_progress(self) -> None:
        for request_id, watcher in list(self._watchers.items()):
            for state in self._live_states(request_id):
                watcher(state.request_index or 0, *_tokens_so_far(state))

    def _live_states(self, request_id: str) -> list[Any]:
        """vLLM's states of the request's samples still running (one per sample: vLLM splits a
        request of ``n`` samples into child requests), found through its own id map, so a step
        looks at the watched requests only, not at every sequence in the engine."""
        processor = self._engine.output_processor
        internal = processor.external_req_ids.get(request_id, ())
        return [processor.request_states[i] for i in internal if i in processor.request_states]

    def _partial_output(self, request_id: str) -> Any:
        """A finished ``RequestOutput`` of what the request ``request_id`` has sampled so far (a
        sample that already ended, or never started, has no tokens)."""
        from vllm.logprobs import FlatLogprobs
        from vllm.outputs import CompletionOutput, RequestOutput

        samples: dict[int, tuple[list[int], list[float], Any]] = {}
        prompt_ids: list[int] = []
        for state in self._live_states(request_id):
            samples[state.request_index or 0] = _tokens_so_far(state)
            prompt_ids = list(state.prompt_token_ids or ())
        outputs = []
        for index in range(self._live.get(request_id, 1)):
            token_ids, logprobs, _ = samples.get(index, ([], [], None))  # cut short: no alternatives kept
            k = len(logprobs)  # one logprob per sampled token (logprobs=0), as vLLM's own outputs have them
            flat = FlatLogprobs(
                start_indices=list(range(k)),
                end_indices=list(range(1, k + 1)),
                token_ids=token_ids[:k],
                logprobs=logprobs,
                ranks=[None] * k,
                decoded_tokens=[None] * k,
            )
            outputs.append(
                CompletionOutput(
                    index=index,
                    text="",
                    token_ids=token_ids[:k],
                    cumulative_logprob=None,
                    logprobs=flat,
                    finish_reason="abort",
                )
            )
        return RequestOutput(request_id, None, prompt_ids, None, outputs, finished=True)

    def run(self, ids: list[str]) -> list[tuple[RequestOutput, list[SampleVersions]]]:
        """Step until the requests ``ids`` finish (other callers' requests step along)."""
        try:
            while not self._done(ids):
                self.step()
        except BaseException:
            self.abort(ids)
            raise
        return self._take(ids)

    async def run_async(self, ids: list[str]) -> list[tuple[RequestOutput, list[SampleVersions]]]:
        """As ``run``, yielding to the event loop after each step: an update from another task
        lands between two steps. A cancelled call aborts its requests in vLLM."""
        try:
            while not self._done(ids):
                self.step()
                await asyncio.sleep(0)
        except BaseException:
            self.abort(ids)
            raise
        return self._take(ids)

    def abort(self, ids: list[str]) -> None:
        """Drop the requests ``ids`` (finished or not) and what is kept of them."""
        running = [i for i in ids if i in self._live and i not in self._finished]
        if running:
            self._engine.abort_request(running)
        self._forget(ids)

    def _done(self, ids: list[str]) -> bool:
        return all(i in self._finished for i in ids)

    def _take(self, ids: list[str]) -> list[tuple[RequestOutput, list[SampleVersions]]]:
        """Each request's final output and, per sample (by ``index``), when its version changed."""
        out = []
        counters = self.counters
        for request_id in ids:
            final = self._finished[request_id]
            samples = sorted(final.outputs, key=lambda c: c.index)
            counters.requests += 1
            counters.prompt_tokens += len(final.prompt_token_ids or ())
            counters.cached_prompt_tokens += final.num_cached_tokens or 0
            counters.generated_tokens += sum(len(s.token_ids) for s in samples)
            versions = [self._versions[(request_id, s.index)] for s in samples]
            out.append((final, versions))
        self._forget(ids)
        return out

    def _forget(self, ids: list[str]) -> None:
        for request_id in ids:
            n = self._live.pop(request_id, 0)
            self._adapter_ids.pop(request_id, None)
            self._finished.pop(request_id, None)
            self._watchers.pop(request_id, None)
            tag = self._tags.pop(request_id, None)
            if tag is not None:
                self._tagged.pop(tag, None)
            for index in range(n):
                self._versions.pop((request_id, index), None)


def _tokens_so_far(state: Any) -> tuple[list[int], list[float], list[Any] | None]:
    """One live sample's token ids, their logprobs and (if asked for) each position's top tokens,
    from its request state in vLLM's output processor (a token counts once its logprob is there)."""
    from forge.generation.vllm_io import flat_logprobs

    token_ids = list(state.detokenizer.output_token_ids)
    flat = state.logprobs_processor.logprobs
    if flat is None:
        return token_ids, [], None
    positions = min(len(token_ids), len(flat.start_indices))
    _, logprobs, tops = flat_logprobs(flat, positions)
    return token_ids[:positions], logprobs, tops
