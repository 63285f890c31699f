"""An OpenAI-compatible HTTP front door to a forge policy service.

``make_app(policy, tokenizer, settings)`` is a FastAPI app with ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template),
``GET /health`` and ``GET /metrics`` (Prometheus text: ``forge.serving.metrics``). Request bodies
are parsed by vLLM's own OpenAI protocol models, so a field's bad value is refused as vLLM's
server refuses it.

Each HTTP request becomes one ``SampleRequest`` routed to the policy service's ``sample``
endpoint: the service prebatches concurrent requests of equal settings into one engine call, and
routes by a key, the ``X-Session-ID`` header, else the body's ``user``, else the prompt text, so
that every turn of a conversation meets the replica that holds its prefix (``key_affinity``). The
prompt goes to the engine as ids: a session's turn that continues its last one keeps that turn's
ids and the sampled ones exactly (``forge.serving.sessions``), so the prefix cache holds and the
model's tokens are never re-encoded. A prompt that does not fit the model is refused here, before
it could fail the batch it would join. The response's ``x-forge-replica`` header names the
replica that served it. ``stream: true`` answers with server-sent events as the replica samples
(``forge.serving.streaming``). A client that disconnects before its answer cancels its request
on the replicas (``Policy.cancel``).

Extensions, as vLLM names them: ``return_token_ids`` adds ``prompt_token_ids`` and each choice's
``token_ids``; every choice carries ``policy_version``, the weights version that sampled its oldest
token (``forge.serving.shapes``). Errors have OpenAI's shape (``{"error": {"message", "type",
"param", "code"}}``): 400 for a bad value (naming the field), 401 for a wrong or missing API key,
404 for an unknown model, 429 with ``Retry-After`` when the server or the service is full, 503
when no replica is up (or every replica that held the request died: the service resends a
request whose replica died first; a streamed one, whose client has part of its answer, ends with
an error event instead), 504 past ``request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from forge.describe import describe
from forge.generation.vllm_io import SamplingError, check_sampling
from forge.serving.metrics import FrontCounts, prometheus_text
from forge.serving.recording import RecordedTurn, Recorder, SessionRecord
from forge.serving.sessions import SessionTurns
from forge.serving.shapes import ChatShape, CompletionShape, ResponseShape
from forge.serving.streaming import DISCONNECTED, first_event, stream_answer, until_disconnected
from forge.types import PackedGroup, Prompt, SampleRequest

if TYPE_CHECKING:
    from forge.controller import RouteTrace

__all__ = ["FrontSettings", "OpenAIError", "make_app"]

logger = logging.getLogger("forge.serving")

CLIENT_CLOSED = 499
"""The status counted for a request whose client disconnected before its answer."""
CANCEL_TIMEOUT_S = 10.0
"""How long the replicas get to confirm a cancel (a dead one never does)."""


@dataclass(frozen=True)
class FrontSettings:
    """What the front door serves and how much it takes on."""

    model_name: str
    """The one model id clients name (``/v1/models`` lists it)."""
    max_model_len: int
    """The engine's context length: a prompt and its ``max_tokens`` must fit in it."""
    default_max_tokens: int = 16
    """``max_tokens`` of a request that sets none."""
    api_key: str | None = None
    """Clients must send ``Authorization: Bearer <api_key>``; None: no key asked."""
    max_concurrent: int = 256
    """Requests served at once; one more gets 429 at once."""
    request_timeout_s: float = 600.0
    """Longest a request may wait for the policy service before it gets 504."""
    batched_engine: bool = True
    """Whether the policy runs vLLM's batched engine (``engine_mode: batched``): ``stream: true``
    and top logprobs need it; the async one serves neither."""
    adapters: tuple[str, ...] = ()
    """Model ids of the LoRA adapters served beside ``model_name`` (a ``MultiLoraPolicy``'s): a
    request naming one goes to its ``sample_adapter`` endpoint, routed and batched by that model."""

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model_name, *self.adapters)


@dataclass(frozen=True)
class Prepared:
    """One request, checked and ready to route."""

    text: str
    request: SampleRequest
    key: str
    """What it routes by: the session, else the body's ``user``, else the prompt."""
    session: str | None
    record: SessionRecord | None
    """A trained session's record, which keeps every completion it was served."""
    continued_from: int | None
    """How many of its prompt ids continue the session's last turn exactly (None: tokenised whole)."""
    adapter: str | None = None
    """The LoRA adapter that samples it (None: the base model)."""


class OpenAIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error object: the response's body, or a stream's last event."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


async def parse_body(request: Request, model: Any) -> tuple[Any, set[str]]:
    """The request's JSON body as ``model`` (a vLLM protocol class), and the fields the client
    sent (the class fills some in: ``max_tokens``); a 400 naming the first bad field, or saying
    the body is not JSON."""
    import json

    from pydantic import ValidationError

    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data), set(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())) or None
        where = f"{param}: " if param else ""
        raise OpenAIError(400, f"{where}{first.get('msg', 'invalid value')}", param=param) from None


class PolicyFront:
    """Turns OpenAI requests into ``SampleRequest``s for one policy service, and its groups back.

    ``recorder``: sessions whose every completion is kept for training (``forge.serving.recording``)."""

    def __init__(self, policy: Any, tokenizer: Any, settings: FrontSettings, recorder: Recorder | None = None) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.settings = settings
        self.sessions = SessionTurns(tokenizer)
        self.recorder = recorder
        self.serving = 0
        """Requests waiting for the policy service now."""
        self.counts = FrontCounts()
        self._cancels: set[asyncio.Task] = set()

    @property
    def served(self) -> int:
        """Requests answered with completions so far."""
        return self.counts.responses[200]

    def check_key(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if given != f"Bearer {key}":
            raise OpenAIError(
                401,
                "a wrong or missing API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                code="invalid_api_key",
            )

    def check_model(self, model: str | None) -> str | None:
        """The adapter ``model`` names (None: the base); a 404 naming the models served otherwise."""
        if model is None or model == self.settings.model_name:
            return None
        if model in self.settings.adapters:
            return model
        raise OpenAIError(
            404,
            f"model {model!r} does not exist; this server serves {list(self.settings.models)}",
            param="model",
            code="model_not_found",
        )

    def completion(self, body: Any, session: str | None, sent: frozenset[str] = frozenset()) -> tuple[Prepared, Any]:
        """``/v1/completions``: one prompt string; ``sent``: the fields the client set."""
        adapter = self.check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise OpenAIError(
                400, "prompt must be one string (token-id and batched prompts are not served)", param="prompt"
            )
        max_tokens = body.max_tokens if "max_tokens" in sent else None  # vLLM's class would say 16
        prepared = self.prepare(prompt, body, max_tokens, session, streamed=bool(body.stream), adapter=adapter)
        return prepared, CompletionShape(body, self.tokenizer, adapter or self.settings.model_name)

    def chat(self, body: Any, session: str | None) -> tuple[Prepared, Any]:
        """``/v1/chat/completions``: the messages through the tokenizer's chat template."""
        adapter = self.check_model(body.model)
        messages = []
        for i, message in enumerate(body.messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, str):
                raise OpenAIError(400, f"messages[{i}].content must be a string", param=f"messages.{i}.content")
            messages.append({"role": message.get("role", "user"), "content": content})
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(400, f"model {self.settings.model_name!r} has no chat template; use /v1/completions")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        max_tokens = body.max_completion_tokens or body.max_tokens
        prepared = self.prepare(text, body, max_tokens, session, streamed=bool(body.stream), adapter=adapter)
        return prepared, ChatShape(body, self.tokenizer, adapter or self.settings.model_name)

    async def answer(self, prepared: Prepared, shape: ResponseShape, http: Request) -> Response:
        """The whole response, or (``stream: true``) the stream of it; either way named with the
        replica that served it (``x-forge-replica``), and cancelled if the client leaves first."""
        from forge.controller import RouteTrace  # monarch is imported once a request is served, not with this module

        trace = RouteTrace()
        if getattr(shape.body, "stream", False):
            return await self._stream(prepared, shape, trace)
        group = await until_disconnected(self.sample(prepared, trace), http)
        if group is DISCONNECTED:  # nobody to answer; nginx's "client closed request", for the counts
            self.counts.answered(CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        prompt_ids = self.finish(prepared, group)
        return JSONResponse(shape.response(group, prompt_ids), headers=_replica_header(trace))

    async def _stream(self, prepared: Prepared, shape: ResponseShape, trace: RouteTrace) -> Response:
        """Start the request with a port for its tokens; answer an error before the first token as
        any request's, then stream (``forge.serving.streaming``)."""
        from monarch.actor import Channel

        port, receiver = Channel.open()
        prepared = dataclasses.replace(prepared, request=dataclasses.replace(prepared.request, stream_to=port))
        result = asyncio.ensure_future(self.sample(prepared, trace, retry=False))
        try:
            first = await first_event(receiver, result)
        except BaseException:
            result.cancel()
            raise
        events = stream_answer(self, prepared, shape, receiver, result, first)
        return StreamingResponse(events, media_type="text/event-stream", headers=_replica_header(trace))

    def prepare(
        self,
        text: str,
        body: Any,
        max_tokens: int | None,
        session: str | None,
        *,
        streamed: bool = False,
        adapter: str | None = None,
    ) -> Prepared:
        """The request for ``text`` at the body's settings, checked before anything is sent: a bad
        setting or a prompt that does not fit is a 400 naming it, a full server a 429."""
        if type(body.logprobs) is int:  # completions: logprobs=k, the k most likely tokens at each position
            top, param = body.logprobs, "logprobs"
        else:  # chat: logprobs is a bool, top_logprobs the count
            top, param = (getattr(body, "top_logprobs", None) or 0) if body.logprobs else 0, "top_logprobs"
        if top > 0 and not self.settings.batched_engine:
            raise OpenAIError(400, f"{param} > 0 needs the policy's batched engine (engine_mode: batched)", param=param)
        if streamed and not self.settings.batched_engine:
            raise OpenAIError(
                400, "stream: true needs the policy's batched engine (engine_mode: batched)", param="stream"
            )
        n = body.n if body.n is not None else 1
        max_tokens = self.settings.default_max_tokens if max_tokens is None else max_tokens
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        top_p = 1.0 if body.top_p is None else float(body.top_p)
        record = self.recorder.get(session) if self.recorder is not None else None
        if record is not None:  # trained on: sampled as the trainer scores it, one trajectory per session
            if n != 1:
                raise OpenAIError(400, f"a recorded (trained) session samples n=1 at a time, got n={n}", param="n")
            temperature, top_p = self.recorder.temperature, 1.0
        try:
            check_sampling(n, temperature, max_tokens, top_p, top)
        except SamplingError as exc:
            name = param if exc.param == "top_logprobs" else exc.param  # completions call the count logprobs
            raise OpenAIError(400, str(exc).replace(exc.param, name, 1), param=name) from None
        stop = body.stop or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        turn = self.sessions.prompt_ids(session, text)
        prompt_ids = turn.prompt_ids
        limit = self.settings.max_model_len
        if len(prompt_ids) + max_tokens > limit:
            raise OpenAIError(
                400,
                f"this model's maximum context length is {limit} tokens; the prompt has {len(prompt_ids)} and "
                f"max_tokens asks for {max_tokens}",
                param="max_tokens" if len(prompt_ids) < limit else "prompt",
                code="context_length_exceeded",
            )
        if self.serving >= self.settings.max_concurrent:
            raise OpenAIError(
                429,
                f"the server serves {self.settings.max_concurrent} requests at once; try again",
                "rate_limit_error",
                headers={"Retry-After": "1"},
            )
        request = SampleRequest(
            Prompt(prompt_id=uuid.uuid4().hex, text=text, answer=""),
            n=n,
            temperature=temperature,
            max_tokens=max_tokens,
            top_p=top_p,
            stop=stop,
            seed=body.seed,
            prompt_ids=tuple(prompt_ids),
            request_id=uuid.uuid4().hex,
            top_logprobs=top,
        )
        key = session or getattr(body, "user", None) or text
        return Prepared(text, request, key, session, record, turn.continued_from, adapter)

    async def sample(self, prepared: Prepared, trace: RouteTrace, *, retry: bool = True) -> PackedGroup:
        """The prepared request's group from the policy service; a failure as an ``OpenAIError``.
        A caller cancelled meanwhile (its client left) cancels the request on the replicas too."""
        self.serving += 1
        try:
            if prepared.adapter is None:
                call = self.policy.sample.route(prepared.request, key=prepared.key, retry=retry, trace=trace)
            else:  # routed (model_aware) and batched by its adapter: the session's key does not apply
                call = self.policy.sample_adapter.route(
                    prepared.request, model_id=prepared.adapter, retry=retry, trace=trace
                )
            return await asyncio.wait_for(call, self.settings.request_timeout_s)
        except asyncio.CancelledError:
            self.cancel_on_replicas(prepared)
            raise
        except Exception as exc:
            if prepared.record is not None:
                prepared.record.failure = exc
            raise self.as_openai_error(exc) from exc
        finally:
            self.serving -= 1

    def finish(self, prepared: Prepared, group: PackedGroup) -> list[int]:
        """Count the request served, keep its session's turn (and its record); the prompt's ids as
        the engine read them."""
        prompt_ids = group.prompt_ids.tolist()  # what the engine sampled from: the ids sent, as it read them
        completions = group.completions
        if prepared.session is not None and len(completions) == 1 and completions[0].finish_reason != "abort":
            self.sessions.remember(prepared.session, prepared.text, prompt_ids, completions[0])
        if prepared.record is not None:
            prepared.record.turns.append(RecordedTurn(prompt_ids, prepared.continued_from, completions[0]))
        self.counts.served(group, len(prompt_ids))
        return prompt_ids

    def cancel_on_replicas(self, prepared: Prepared) -> None:
        """Ask every replica to drop the request (its client went away); in the background, so a
        cancelled caller does not wait for it."""
        self.counts.cancelled += 1
        task = asyncio.get_running_loop().create_task(self._cancel(prepared.request.request_id))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _cancel(self, request_id: str | None) -> None:
        try:
            await self.policy.cancel.fanout(request_id, timeout=CANCEL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a replica that is gone holds nothing to cancel
            logger.info("cancelling request %s on the policy replicas failed: %s", request_id, describe(exc))

    def as_openai_error(self, exc: BaseException) -> OpenAIError:
        """The service's failure of a request, as the client is answered."""
        from forge.controller import NoHealthyReplica, Overloaded, ReplicaFailed, RequestTimeout

        if isinstance(exc, OpenAIError):
            return exc
        if isinstance(exc, Overloaded):
            return OpenAIError(429, str(exc), "rate_limit_error", headers={"Retry-After": "1"})
        if isinstance(exc, NoHealthyReplica):
            return OpenAIError(503, str(exc), "service_unavailable", headers={"Retry-After": "5"})
        if isinstance(exc, (asyncio.TimeoutError, RequestTimeout)):
            return OpenAIError(
                504, f"the policy did not answer within {self.settings.request_timeout_s:g} s", "timeout"
            )
        if isinstance(exc, ReplicaFailed):  # it died holding the request, and every resend did too
            return OpenAIError(503, describe(exc), "service_unavailable", headers={"Retry-After": "5"})
        return OpenAIError(500, describe(exc), "server_error")  # the engine refused the call: say why


def _replica_header(trace: RouteTrace) -> dict[str, str]:
    return {} if trace.replica_id is None else {"x-forge-replica": str(trace.replica_id)}


def make_app(policy: Any, tokenizer: Any, settings: FrontSettings, recorder: Recorder | None = None) -> FastAPI:
    """The FastAPI app serving ``policy`` (a forge policy service handle) as an OpenAI API;
    ``recorder``'s sessions are kept for training."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    front = PolicyFront(policy, tokenizer, settings, recorder)
    app = FastAPI(title="forge", docs_url=None, redoc_url=None)
    app.state.front = front

    def api_key(request: Request) -> None:  # before the body is read: a wrong key is 401, whatever it sent
        front.check_key(request)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        front.counts.answered(exc.status)
        return exc.response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        healthy = len(policy.service.healthy_replicas())
        if not healthy:
            raise OpenAIError(503, "no policy replica is healthy", "service_unavailable")
        return {"status": "ok", "healthy_replicas": healthy}

    @app.get("/metrics")
    async def metrics() -> Response:
        text = await prometheus_text(policy, front.counts, front.serving)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(api_key)])
    async def models() -> dict[str, Any]:
        base = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "forge"}
        adapters = [{**base, "id": name, "parent": settings.model_name} for name in settings.adapters]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/completions", dependencies=[Depends(api_key)])
    async def completions(request: Request) -> Response:
        body, sent = await parse_body(request, CompletionRequest)
        prepared, shape = front.completion(body, request.headers.get("x-session-id"), frozenset(sent))
        return await front.answer(prepared, shape, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(api_key)])
    async def chat_completions(request: Request) -> Response:
        body, _ = await parse_body(request, ChatCompletionRequest)
        prepared, shape = front.chat(body, request.headers.get("x-session-id"))
        return await front.answer(prepared, shape, request)

    return app
