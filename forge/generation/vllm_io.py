"""What both vLLM engines share (``VllmEngine`` and ``AsyncVllmEngine``): the engine's
arguments, sampling parameters, prompts in as token ids, ``Completion``s out with each token's
version, and the checks on a weight update before it reaches vLLM."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from forge.generation.engine_steps import SampleVersions
from forge.generation.weight_sync import TIED_HEAD, validate_state_dict
from forge.types import Completion

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams

__all__ = [
    "CPU_BLOCK_SIZE",
    "EXTENSION",
    "Prompts",
    "checked_weights",
    "engine_args",
    "local_model_dir",
    "safetensors_blob",
    "sampling_params",
    "to_completions",
    "token_prompts",
]

EXTENSION = "forge.generation.weight_sync.WeightSyncExtension"
MAX_TOP_LOGPROBS = 20
"""The most alternatives per token a request may ask for (vLLM's default ``max_logprobs``)."""
CPU_BLOCK_SIZE = 32
"""KV block size on CPU: the smallest vLLM's CPU attention supports (a multiple of 32)."""
Prompts = Sequence[str] | Sequence[Sequence[int]] | Sequence[torch.Tensor]


def engine_args(
    model_dir: Path,
    max_model_len: int,
    seed: int,
    dtype: str,
    kv_cache_bytes: int,
    enforce_eager: bool,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` / ``AsyncEngineArgs`` for a forge engine."""
    for key in ("logprobs_mode", "worker_extension_cls"):
        if key in extra:
            raise ValueError(f"{key} is fixed by forge's vLLM engines; do not pass it")
    args: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        enforce_eager=enforce_eager,
        kv_cache_memory_bytes=kv_cache_bytes,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=EXTENSION,
        # Said, not left to vLLM's platform default: a multi-turn trajectory's next turn reuses
        # the KV blocks of its history. Safe across weight updates: update_weights resets it.
        enable_prefix_caching=True,
    )
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # vLLM's CPU default is 128-token blocks: a 10-token RL sequence would hold 128 tokens of
        # cache, and a 16 MiB cache only 127 sequences, so a 64 x 8 batch of 3 tokens took 13
        # engine steps instead of 3.
        args["block_size"] = CPU_BLOCK_SIZE
    args.update(extra)
    return args


class SamplingError(ValueError):
    """A sampling argument out of range; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_sampling(n: int, temperature: float, max_tokens: int, top_p: float, top_logprobs: int = 0) -> None:
    """``SamplingError`` naming the first argument out of range: what every engine call checks,
    and what a front door checks before a request joins a batch (one bad request fails a call)."""
    if n < 1:
        raise SamplingError("n", f"n must be >= 1, got {n}")
    if max_tokens < 1:
        raise SamplingError("max_tokens", f"max_tokens must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise SamplingError("temperature", f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise SamplingError("top_p", f"top_p must be in (0, 1], got {top_p}")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise SamplingError(
            "top_logprobs", f"top_logprobs must be an int in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs!r}"
        )


def sampling_params(
    num_prompts: int,
    n: int,
    temperature: float,
    max_tokens: int,
    top_p: float,
    stop: list[str] | None,
    seed: int | list[int] | None,
    stop_token_ids: list[int] | None = None,
    top_logprobs: int = 0,
) -> SamplingParams | list[SamplingParams]:
    """Check the sampling arguments and build vLLM's ``SamplingParams`` for a call.

    One object for all prompts, or one per prompt when ``seed`` is given: an int seeds prompt
    ``i`` with ``seed + i * n``, so every sample has its own stream; a list gives each prompt its
    own seed (the same samples for a prompt whatever else shares its batch). ``top_logprobs``:
    how many of the most likely tokens at each position to return beside the sampled one.
    """
    if isinstance(seed, list) and len(seed) != num_prompts:
        raise ValueError(f"seed lists {len(seed)} seeds for {num_prompts} prompts; give one per prompt")
    check_sampling(n, temperature, max_tokens, top_p, top_logprobs)
    bad = [t for t in stop_token_ids or () if isinstance(t, bool) or not isinstance(t, int) or t < 0]
    if bad:
        raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {bad[0]!r}")
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    def make(seed: int | None) -> SamplingParams:
        return SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            # Explicit, so a checkpoint's generation_config cannot change the distribution the
            # trainer assumes.
            top_k=0,
            min_p=0.0,
            repetition_penalty=1.0,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=list(stop_token_ids or ()),
            seed=seed,
            logprobs=top_logprobs,  # the sampled token's logprob, then the top ones asked for
            flat_logprobs=True,  # a few flat lists per sample instead of a dict per token
            # Stop strings are matched on text; without them the text is decoded once at the
            # end (``to_completions``), not token by token.
            detokenize=bool(stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    if seed is None:
        return make(None)
    if isinstance(seed, list):
        return [make(s) for s in seed]
    return [make(seed + i * n) for i in range(num_prompts)]


def token_prompts(prompts: Prompts, tokenizer: Any) -> list[Any]:
    """vLLM ``TokensPrompt``s; string prompts are tokenised together, as vLLM would one by one."""
    from vllm.inputs import TokensPrompt

    ids: list[list[int] | None] = [_prompt_ids(p, i) for i, p in enumerate(prompts)]
    strings = [i for i, p in enumerate(ids) if p is None]
    if strings:
        encoded = tokenizer([prompts[i] for i in strings], add_special_tokens=True).input_ids
        for i, prompt_ids in zip(strings, encoded):
            ids[i] = prompt_ids
    return [TokensPrompt(prompt_token_ids=p) for p in ids]


def to_completions(
    outputs: Sequence[RequestOutput], token_versions: int | list[list[SampleVersions]], *, decode_with: Any | None
) -> list[list[Completion]]:
    """One list of ``Completion``s (in sample order) per vLLM ``RequestOutput``.

    ``token_versions``: the version of every sampled token (per output, per sample in order),
    or one version that sampled them all. ``decode_with``: the tokenizer that decodes every
    sample's text in one call when vLLM did not detokenise (``detokenize=False``); None takes vLLM's text.
    """
    samples = [sorted(out.outputs, key=lambda c: c.index) for out in outputs]
    flat = [s for group in samples for s in group]
    if decode_with is None:
        texts = [s.text for s in flat]
    else:
        texts = decode_with.batch_decode([list(s.token_ids) for s in flat], skip_special_tokens=True)
    completions: list[list[Completion]] = []
    k = 0
    for i, (out, group) in enumerate(zip(outputs, samples)):
        prompt_ids = torch.tensor(out.prompt_token_ids, dtype=torch.long)
        row = []
        for j, sample in enumerate(group):
            token_ids = list(sample.token_ids)
            stamps = SampleVersions(token_versions) if isinstance(token_versions, int) else token_versions[i][j]
            versions = stamps.per_token(len(token_ids))
            logprobs, tops = _sampled_logprobs(sample, token_ids, out.request_id)
            row.append(
                Completion(
                    prompt_ids=prompt_ids,
                    token_ids=torch.tensor(token_ids, dtype=torch.long),
                    logprobs=torch.tensor(logprobs, dtype=torch.float32),
                    text=texts[k],
                    # The oldest token's: what max_policy_age and the buffer go by.
                    policy_version=stamps.oldest(len(token_ids)),
                    finish_reason=str(sample.finish_reason),
                    token_versions=versions,
                    top_logprobs=tops,
                )
            )
            k += 1
        completions.append(row)
    return completions


def checked_weights(
    state_dict: Mapping[str, torch.Tensor], version: int, spec: Mapping[str, tuple[int, ...]], tied: bool
) -> dict[str, torch.Tensor]:
    """Validate an update (``ValueError`` names the bad key) and drop a tied head."""
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"version must be an int, got {version!r}")
    validate_state_dict(state_dict, spec, tied=tied)
    # A tied head is restored from the embedding inside the worker; sending it would also make
    # safetensors refuse the shared tensor.
    return {k: v for k, v in state_dict.items() if not (tied and k == TIED_HEAD)}


def safetensors_blob(weights: Mapping[str, torch.Tensor]) -> bytes:
    """``weights`` as safetensors bytes: what crosses to an engine in another process."""
    from safetensors.torch import save

    return save({k: v.detach().contiguous().cpu() for k, v in weights.items()})


def local_model_dir(model_path: str | os.PathLike) -> Path:
    """The local folder of a checkpoint: a path, or a hub id already in the local HF cache."""
    path = Path(model_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model_path), local_files_only=True))
    except Exception as err:
        raise ValueError(
            f"model_path {str(model_path)!r} is neither a folder nor a model in the local "
            f"Hugging Face cache; weights cannot be downloaded here"
        ) from err


def _prompt_ids(prompt: Any, index: int) -> list[int] | None:
    """A prompt's token ids, None for a string; reject anything else by index."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(f"prompts[{index}] must be a 1-D tensor, got {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        if not prompt:
            raise ValueError(f"prompts[{index}] is empty")
        return list(prompt)
    raise ValueError(f"prompts[{index}] must be a str or a sequence of int token ids, got {type(prompt)}")


def flat_logprobs(flat: Any, positions: int) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
    """The first ``positions`` of vLLM's flat logprobs: each position's sampled token and its
    logprob (vLLM puts it first), and with ``logprobs=k`` the top ``k`` there, most likely first
    (None when only the sampled ones were asked for)."""
    if len(flat.start_indices) == len(flat.token_ids):  # logprobs=0: one entry per position
        return list(flat.token_ids[:positions]), list(flat.logprobs[:positions]), None
    starts, ends = flat.start_indices[:positions], flat.end_indices[:positions]
    sampled = [flat.token_ids[a] for a in starts]
    logprobs = [flat.logprobs[a] for a in starts]
    tops = [[(flat.token_ids[j], flat.logprobs[j]) for j in range(a + 1, b)] for a, b in zip(starts, ends)]
    return sampled, logprobs, tops


def _sampled_logprobs(
    sample: Any, token_ids: list[int], request_id: str
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """Each sampled token's logprob from vLLM's flat logprobs, and the top ones if asked for."""
    flat = sample.logprobs
    if flat is None:
        raise RuntimeError(f"vLLM returned no logprob for some tokens of request {request_id}")
    sampled, logprobs, tops = flat_logprobs(flat, len(flat.start_indices))
    if sampled != token_ids:
        raise RuntimeError(f"vLLM returned no logprob for some tokens of request {request_id}")
    return logprobs, tops
