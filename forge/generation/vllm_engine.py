"""``VllmEngine``: the policy's sampler, a thin synchronous wrapper over an in-process vLLM.

Why it looks like this (measurements in /work/shared/research/vllm_cpu.md):

- **In-process ``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.** On CPU this starts in
  ~2.5 s instead of ~20 s, uses one process instead of three and is as fast as anything else
  for one batched call per step. It changes the host process (global RNG seed, a gloo process
  group, thread settings), so run the engine in its own actor, not next to a trainer.
- **One ``LLM.generate`` call per batch**: vLLM batches all prompts x ``n`` samples itself.
- **``logprobs_mode="processed_logprobs"``**: the behaviour logprob of each sampled token is
  ``log_softmax(logits / T)``, the quantity the trainer computes
  (``forge.models.logprobs.padded_token_logprobs``). The default mode ignores the temperature.
- **Weights are reloaded in place** (``forge.generation.weight_sync``), validated first, and the
  prefix cache is reset after every update so no KV block computed with old weights is reused.

The class is plain Python: the caller (a ``ForgeActor``) owns concurrency and lifecycle.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from forge.generation.weight_sync import TIED_HEAD, checkpoint_spec, validate_state_dict
from forge.types import Completion

if TYPE_CHECKING:
    from vllm import LLM, RequestOutput

__all__ = ["VllmEngine", "configure_vllm_env"]

_EXTENSION = "forge.generation.weight_sync.WeightSyncExtension"


def configure_vllm_env() -> None:
    """Set forge's defaults for the environment vLLM reads when an engine starts.

    A variable the user already set keeps its value (e.g. ``VLLM_ENABLE_V1_MULTIPROCESSING=1``
    to run the engine in child processes). vLLM caches its environment once an engine runs, so
    this must happen before the process's first engine; ``create`` calls it.
    ``OMP_NUM_THREADS=1``: for small models on shared CPUs, more threads were never faster and
    once 8x slower. (``create`` also swaps the sampler's compiled rank kernel for an eager one
    on CPU, see ``apply_cpu_sampler_fix``; on a GPU vLLM's compilation is left alone.)
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


class VllmEngine:
    """Batched sampling with behaviour logprobs, and in-place weight updates, on one vLLM.

    Build it with ``VllmEngine.create``. ``version`` is the policy version of the loaded
    weights (0 for the checkpoint); every ``Completion`` carries the version it was sampled
    with, so the trainer can tell how stale a sample is. Not thread-safe: call it from one
    thread (an actor's endpoints run one at a time), so no update lands mid-generate.
    """

    def __init__(
        self,
        llm: LLM,
        *,
        weight_spec: dict[str, tuple[int, ...]],
        tied_embeddings: bool,
        in_process: bool,
    ) -> None:
        """Wrap a started ``LLM``; prefer ``VllmEngine.create``, which sets up what this needs."""
        self._llm: LLM | None = llm
        self._weight_spec = weight_spec
        self._tied = tied_embeddings
        self._in_process = in_process
        self._version = 0

    @classmethod
    def create(
        cls,
        model_path: str | os.PathLike,
        *,
        max_model_len: int,
        seed: int,
        dtype: str = "float32",
        kv_cache_bytes: int = 64 << 20,
        enforce_eager: bool = True,
        **engine_kwargs: Any,
    ) -> VllmEngine:
        """Start vLLM on the Hugging Face checkpoint folder ``model_path`` (~3 s on CPU).

        ``kv_cache_bytes`` is allocated in full at start (it adds to RSS); 64 MiB holds ~16k
        tokens of the tiny model. Extra ``engine_kwargs`` go to ``vllm.LLM`` unchanged.
        """
        model_dir = _local_model_dir(model_path)
        configure_vllm_env()
        from vllm import LLM
        from vllm import envs as vllm_envs

        for key in ("logprobs_mode", "worker_extension_cls"):
            if key in engine_kwargs:
                raise ValueError(f"{key} is fixed by VllmEngine; do not pass it")
        llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            kv_cache_memory_bytes=kv_cache_bytes,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=_EXTENSION,
            **engine_kwargs,
        )
        # In the worker, wherever it runs: importing the extension there is not enough, since
        # a spawned worker may have imported forge before vllm.
        llm.collective_rpc("forge_apply_cpu_sampler_fix")
        text_config = llm.llm_engine.model_config.hf_text_config
        return cls(
            llm,
            weight_spec=checkpoint_spec(model_dir),
            tied_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
            in_process=not vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING,
        )

    @property
    def version(self) -> int:
        """Policy version of the weights now loaded."""
        return self._version

    @property
    def llm(self) -> LLM:
        """The underlying ``vllm.LLM``, for what this class does not wrap."""
        if self._llm is None:
            raise RuntimeError("VllmEngine was shut down")
        return self._llm

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | Sequence[torch.Tensor],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
    ) -> list[list[Completion]]:
        """Sample ``n`` completions per prompt in one batched engine call.

        Prompts are strings (tokenised by the model's tokenizer) or token ids. Returns one list
        of ``n`` completions per prompt, in order. ``temperature=0`` is greedy. With ``top_p <
        1`` the logprobs are renormalised over the nucleus, so the trainer must apply the same
        mask to match them. ``seed`` makes the call reproducible; each sample still gets its own
        stream, so duplicate prompts give different samples.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if not prompts:
            return []

        inputs = [_as_prompt(p, i, TokensPrompt) for i, p in enumerate(prompts)]
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                # Explicit, so a checkpoint's generation_config cannot change the distribution
                # the trainer assumes.
                top_k=0,
                min_p=0.0,
                repetition_penalty=1.0,
                max_tokens=max_tokens,
                stop=stop,
                seed=None if seed is None else seed + i * n,
                logprobs=0,  # only the sampled token's logprob
            )
            for i in range(len(inputs))
        ]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return [self._completions(out) for out in outputs]

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights in place and record their policy ``version``.

        ``state_dict`` holds checkpoint-format names (as HF ``state_dict()``); it is validated
        before anything reaches vLLM, so a bad one raises ``ValueError`` naming the key and
        leaves the engine on its old weights. Then the prefix cache is cleared.
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        validate_state_dict(state_dict, self._weight_spec, tied=self._tied)
        # A tied head is restored from the embedding inside the worker; sending it would also
        # make safetensors refuse the shared tensor.
        weights = {k: v for k, v in state_dict.items() if not (self._tied and k == TIED_HEAD)}
        if self._in_process:
            self.llm.collective_rpc("forge_load_state_dict", args=(weights,))
        else:
            from safetensors.torch import save

            blob = save({k: v.detach().contiguous().cpu() for k, v in weights.items()})
            self.llm.collective_rpc("forge_load_safetensors", args=(blob,))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self._version = version

    def shutdown(self) -> None:
        """Stop the engine and free its memory and process group; safe to call twice."""
        if self._llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._llm.llm_engine.engine_core.shutdown()
        self._llm = None
        cleanup_dist_env_and_memory()
        gc.collect()

    def _completions(self, out: RequestOutput) -> list[Completion]:
        """Turn one vLLM ``RequestOutput`` into ``Completion``s, in sample order."""
        prompt_ids = torch.tensor(out.prompt_token_ids, dtype=torch.long)
        completions = []
        for sample in sorted(out.outputs, key=lambda c: c.index):
            token_ids = list(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
                raise RuntimeError(
                    f"vLLM returned no logprob for some tokens of request {out.request_id}"
                )
            logprobs = [sample.logprobs[i][tok].logprob for i, tok in enumerate(token_ids)]
            completions.append(
                Completion(
                    prompt_ids=prompt_ids,
                    token_ids=torch.tensor(token_ids, dtype=torch.long),
                    logprobs=torch.tensor(logprobs, dtype=torch.float32),
                    text=sample.text,
                    policy_version=self._version,
                    finish_reason=str(sample.finish_reason),
                )
            )
        return completions


def _local_model_dir(model_path: str | os.PathLike) -> Path:
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


def _as_prompt(prompt: Any, index: int, tokens_prompt: type) -> Any:
    """A vLLM prompt for a string or a sequence of token ids; reject anything else by index."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(f"prompts[{index}] must be a 1-D tensor, got {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        if not prompt:
            raise ValueError(f"prompts[{index}] is empty")
        return tokens_prompt(prompt_token_ids=list(prompt))
    raise ValueError(
        f"prompts[{index}] must be a str or a sequence of int token ids, got {type(prompt)}"
    )
