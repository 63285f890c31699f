"""An OpenAI-compatible HTTP front door to a forge policy service.

``make_app(policy, tokenizer, settings)`` is a FastAPI app with ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template) and
``GET /health``. Request bodies are parsed by vLLM's own OpenAI protocol models, so a field's bad
value is refused as vLLM's server refuses it.

Each HTTP request becomes one ``SampleRequest`` routed to the policy service's ``sample``
endpoint: the service prebatches concurrent requests of equal settings into one engine call, and
routes by a key, the ``X-Session-ID`` header, else the body's ``user``, else the prompt text, so
that every turn of a conversation meets the replica that holds its prefix (``key_affinity``). The
prompt goes to the engine as ids: a session's turn that continues its last one keeps that turn's
ids and the sampled ones exactly (``forge.serving.sessions``), so the prefix cache holds and the
model's tokens are never re-encoded. A prompt that does not fit the model is refused here, before
it could fail the batch it would join.

Extensions, as vLLM names them: ``return_token_ids`` adds ``prompt_token_ids`` and each choice's
``token_ids``; every choice carries ``policy_version``, the weights version that sampled its oldest
token. Errors have OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): 400 for
a bad value (naming the field), 401 for a wrong or missing API key, 404 for an unknown model, 429
with ``Retry-After`` when the server or the service is full, 503 when no replica is up (or every
replica that held the request died: the service resends a request whose replica died first), 504
past ``request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from forge.generation.vllm_io import SamplingError, check_sampling
from forge.serving.recording import RecordedTurn, Recorder
from forge.serving.sessions import SessionTurns
from forge.types import PackedGroup, Prompt, SampleRequest

__all__ = ["FrontSettings", "OpenAIError", "make_app"]


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

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


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
        self._serving = 0
        self.served = 0
        """Requests answered with completions so far."""

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

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise OpenAIError(
                404,
                f"model {model!r} does not exist; this server serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def completion(self, body: Any, session: str | None, sent: frozenset[str] = frozenset()) -> dict[str, Any]:
        """``/v1/completions``: one prompt string; ``sent``: the fields the client set."""
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse

        self.check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise OpenAIError(
                400, "prompt must be one string (token-id and batched prompts are not served)", param="prompt"
            )
        max_tokens = body.max_tokens if "max_tokens" in sent else None  # vLLM's class would say 16
        group, prompt_ids = await self._sample(prompt, body, max_tokens, session)
        choices = []
        for index, completion in enumerate(group.completions):
            choice = {"index": index, "text": completion.text, "finish_reason": completion.finish_reason}
            if body.logprobs is not None:
                choice["logprobs"] = self._completion_logprobs(completion, body.logprobs)
            choices.append(self._extended(choice, completion, body))
        return self._response(CompletionResponse, "cmpl", choices, prompt_ids, group, body)

    async def chat(self, body: Any, session: str | None) -> dict[str, Any]:
        """``/v1/chat/completions``: the messages through the tokenizer's chat template."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

        self.check_model(body.model)
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
        group, prompt_ids = await self._sample(text, body, max_tokens, session)
        choices = []
        for index, completion in enumerate(group.completions):
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": completion.text},
                "finish_reason": completion.finish_reason,
            }
            if body.logprobs:
                choice["logprobs"] = {"content": self._chat_logprobs(completion)}
            choices.append(self._extended(choice, completion, body))
        return self._response(ChatCompletionResponse, "chatcmpl", choices, prompt_ids, group, body)

    def _response(
        self, cls: Any, prefix: str, choices: list[dict[str, Any]], prompt_ids: list[int], group: PackedGroup, body: Any
    ) -> dict[str, Any]:
        """The response body, checked by vLLM's protocol class ``cls``; the choices keep forge's
        extensions (``policy_version``, ``token_ids``), and ``return_token_ids`` adds the prompt's."""
        response = cls(
            id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.settings.model_name,
            choices=choices,
            usage=self._usage(prompt_ids, group),
        ).model_dump(exclude_none=True)
        if getattr(body, "return_token_ids", None):
            response["prompt_token_ids"] = prompt_ids
        response["choices"] = choices
        return response

    async def _sample(
        self, text: str, body: Any, max_tokens: int | None, session: str | None
    ) -> tuple[PackedGroup, list[int]]:
        from forge.controller import NoHealthyReplica, Overloaded, ReplicaFailed, RequestTimeout
        from forge.describe import describe

        if getattr(body, "stream", False):
            raise OpenAIError(400, "stream: true is not served yet; ask without it", param="stream")
        top = getattr(body, "top_logprobs", None) or 0  # chat
        alternatives = body.logprobs if type(body.logprobs) is int else 0  # completions (chat's is a bool)
        if top > 0 or alternatives > 1:
            raise OpenAIError(
                400, "only the sampled tokens' logprobs are served (logprobs <= 1, no top_logprobs)", param="logprobs"
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
            check_sampling(n, temperature, max_tokens, top_p)
        except SamplingError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from None
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
        if self._serving >= self.settings.max_concurrent:
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
        )
        key = session or getattr(body, "user", None) or text
        self._serving += 1
        try:
            try:
                group = await asyncio.wait_for(
                    self.policy.sample.route(request, key=key), self.settings.request_timeout_s
                )
            except Exception as exc:
                if record is not None:
                    record.failure = exc
                raise
        except Overloaded as exc:
            raise OpenAIError(429, str(exc), "rate_limit_error", headers={"Retry-After": "1"}) from exc
        except NoHealthyReplica as exc:
            raise OpenAIError(503, str(exc), "service_unavailable", headers={"Retry-After": "5"}) from exc
        except (asyncio.TimeoutError, RequestTimeout) as exc:
            raise OpenAIError(
                504, f"the policy did not answer within {self.settings.request_timeout_s:g} s", "timeout"
            ) from exc
        except ReplicaFailed as exc:  # it died holding the request, and every resend did too
            raise OpenAIError(503, describe(exc), "service_unavailable", headers={"Retry-After": "5"}) from exc
        except Exception as exc:  # the engine refused the call: say why, in OpenAI's shape
            raise OpenAIError(500, describe(exc), "server_error") from exc
        finally:
            self._serving -= 1
        self.served += 1
        prompt_ids = group.prompt_ids.tolist()  # what the engine sampled from: the ids sent, as it read them
        if session is not None and len(group.completions) == 1:
            self.sessions.remember(session, text, prompt_ids, group.completions[0])
        if record is not None:
            record.turns.append(RecordedTurn(prompt_ids, turn.continued_from, group.completions[0]))
        return group, prompt_ids

    def _extended(self, choice: dict[str, Any], completion: Any, body: Any) -> dict[str, Any]:
        choice["policy_version"] = int(completion.policy_version)
        if getattr(body, "return_token_ids", None):
            choice["token_ids"] = completion.token_ids.tolist()
        return choice

    def _tokens(self, completion: Any) -> list[str]:
        return [self.tokenizer.decode([t]) for t in completion.token_ids.tolist()]

    def _completion_logprobs(self, completion: Any, k: int) -> dict[str, Any]:
        tokens = self._tokens(completion)
        logprobs = [float(x) for x in completion.logprobs.tolist()]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        top = [{t: lp} for t, lp in zip(tokens, logprobs)] if k == 1 else None
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, completion: Any) -> list[dict[str, Any]]:
        return [
            {"token": t, "logprob": float(lp), "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(self._tokens(completion), completion.logprobs.tolist())
        ]

    @staticmethod
    def _usage(prompt_ids: list[int], group: PackedGroup) -> dict[str, int]:
        completion_tokens = sum(int(c.token_ids.numel()) for c in group.completions)
        return {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        }


def make_app(policy: Any, tokenizer: Any, settings: FrontSettings, recorder: Recorder | None = None) -> FastAPI:
    """The FastAPI app serving ``policy`` (a forge policy service handle) as an OpenAI API;
    ``recorder``'s sessions are kept for training."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    front = PolicyFront(policy, tokenizer, settings, recorder)
    app = FastAPI(title="forge", docs_url=None, redoc_url=None)
    app.state.front = front

    @app.middleware("http")
    async def _api_key(request: Request, call_next: Any) -> Any:
        if request.url.path.startswith("/v1/"):  # before the body is read: a wrong key is 401, whatever it sent
            try:
                front.check_key(request)
            except OpenAIError as exc:
                return exc.response()
        return await call_next(request)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        healthy = len(policy.service.healthy_replicas())
        if not healthy:
            raise OpenAIError(503, "no policy replica is healthy", "service_unavailable")
        return {"status": "ok", "healthy_replicas": healthy}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "forge"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body, sent = await parse_body(request, CompletionRequest)
        return await front.completion(body, request.headers.get("x-session-id"), frozenset(sent))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> dict[str, Any]:
        body, _ = await parse_body(request, ChatCompletionRequest)
        return await front.chat(body, request.headers.get("x-session-id"))

    return app
