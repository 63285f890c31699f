"""In-place weight reload for a running vLLM engine, and the checks that make it safe.

Every RL step the trainer's new weights must reach the generator without restarting vLLM
(seconds on CPU). vLLM's ``Worker.reload_weights`` does this in a small fraction of that (see
``docs/benchmarks.md``, "Figures the code rests on"), but it has sharp edges that this module
files down:

- **A reload that fails partway leaves layers on the meta device** and the next forward pass
  kills the engine. So ``validate_state_dict`` checks every key, shape and type against the
  checkpoint *before* anything is sent, and names the bad key.
- **Tied embeddings:** a layer-wise reload does not re-tie ``lm_head`` to the embedding; without
  an explicit ``lm_head.weight`` the head silently keeps the old weights. The extension adds it
  back from ``model.embed_tokens.weight``. A tied checkpoint may store ``lm_head.weight`` or
  not (Qwen3-1.7B does, the 0.6B and 4B do not); either way the sender may leave it out.
- **The file transport writes to ``/dev/shm``**, a container's is often 64 MB, and a full
  ``/dev/shm`` surfaced mid-run. ``check_file_transport_space`` compares its free space with
  what the trainer will keep there (``file_transport_bytes``) before the run starts.
- **Across processes** (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) ``collective_rpc`` arguments go
  through msgpack, which turns tensors into lists; the bytes path sends a safetensors blob.

``WeightSyncExtension`` is given to vLLM as ``worker_extension_cls``; vLLM mixes it into its
worker class, so its methods run with the worker as ``self`` and are called through
``LLM.collective_rpc(name, args=...)``. The caller must reset the prefix cache afterwards: cached
KV blocks were computed with the old weights.

The extension also applies the CPU sampler fix (``apply_cpu_sampler_fix``) inside each worker,
where the sampler runs, even when vLLM spawned the worker as another process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TIED_HEAD",
    "TIED_EMBEDDING",
    "WeightSyncExtension",
    "apply_cpu_sampler_fix",
    "check_file_transport_space",
    "checkpoint_spec",
    "checkpoint_ties_embeddings",
    "file_transport_bytes",
    "validate_state_dict",
    "weights_fingerprint",
]

TIED_HEAD = "lm_head.weight"
TIED_EMBEDDING = "model.embed_tokens.weight"


def checkpoint_spec(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a Hugging Face safetensors checkpoint folder.

    Read from the file headers only (no tensor data is loaded), so it is cheap for any size.
    These names and shapes are what ``reload_weights`` accepts in checkpoint format.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}; weight sync needs them")
    spec: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                spec[name] = tuple(f.get_slice(name).get_shape())
    return spec


def checkpoint_ties_embeddings(model_config: Any) -> bool:
    """Whether the checkpoint's config ties ``lm_head`` to the embedding, from vLLM's model config.

    vLLM (0.32) unties a tied config whose checkpoint also stores ``lm_head.weight`` (Qwen3-1.7B)
    while it loads, and re-ties them if equal; its config then says untied. The trainer (HF) still
    ties them and publishes no head, so what counts here is the checkpoint's own setting.
    """
    text_config = model_config.hf_text_config
    return bool(getattr(text_config, "tie_word_embeddings", False)) or bool(
        getattr(model_config, "word_embeddings_untied_by_checkpoint", False)
    )


def validate_state_dict(
    state_dict: Mapping[str, Any],
    spec: Mapping[str, tuple[int, ...]],
    *,
    tied: bool,
) -> None:
    """Raise ``ValueError`` naming the first bad key unless ``state_dict`` matches ``spec``.

    Every checkpoint tensor must be present with its exact shape as a floating-point tensor;
    unknown keys are refused too (a typo would otherwise be silently ignored by vLLM). With
    ``tied`` embeddings, ``lm_head.weight`` is optional whether or not the checkpoint stores it
    (it is restored from the embedding); if present (HF ``state_dict()`` has it) it must equal
    the embedding. dtypes may differ from the engine's; vLLM casts on load.
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict must be a mapping of name -> tensor, got {type(state_dict)}")
    missing = [k for k in spec if k not in state_dict and not (tied and k == TIED_HEAD)]
    if missing:
        raise ValueError(
            f"state_dict is missing {len(missing)} key(s), first {missing[0]!r}; "
            f"it must hold every tensor of the checkpoint"
        )
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(value)}")
        if not value.is_floating_point():
            raise ValueError(f"state_dict[{name!r}] must be a floating-point tensor, got {value.dtype}")
        if name == TIED_HEAD and tied:
            expected = spec.get(TIED_HEAD, spec.get(TIED_EMBEDDING))
        elif name in spec:
            expected = spec[name]
        else:
            raise ValueError(f"state_dict has unexpected key {name!r}: not in the checkpoint")
        if tuple(value.shape) != tuple(expected):
            raise ValueError(
                f"state_dict[{name!r}] has shape {tuple(value.shape)}, the checkpoint has {tuple(expected)}"
            )
    head = state_dict.get(TIED_HEAD)
    if tied and head is not None:
        embed = state_dict[TIED_EMBEDDING]
        if head.data_ptr() != embed.data_ptr() and not torch.equal(head, embed.to(head)):
            raise ValueError(
                f"state_dict[{TIED_HEAD!r}] differs from {TIED_EMBEDDING!r}, but the model "
                f"ties them; send equal tensors or leave {TIED_HEAD!r} out"
            )


def file_transport_bytes(
    spec: Mapping[str, tuple[int, ...]], dtype: torch.dtype, *, tied: bool, copies: int = 3
) -> int:
    """Bytes the file transport holds at its peak for a checkpoint of ``spec`` in ``dtype``.

    The trainer keeps three files of the model's layout and rewrites them in turn
    (``forge.generation.weight_files.WeightFiles``): ``copies=3``. A tied head is not written.
    """
    element = torch.empty((), dtype=dtype).element_size()
    numel = sum(math.prod(shape) for name, shape in spec.items() if not (tied and name == TIED_HEAD))
    return copies * numel * element


def check_file_transport_space(folder: str | Path, needed: int) -> None:
    """Raise ``ValueError`` unless the filesystem of ``folder`` has ``needed`` bytes free.

    The folder need not exist yet (its nearest existing parent is checked). The message names
    the sizes and the two ways out: a bigger ``/dev/shm`` or another ``weight_sync.dir``, or
    the ``message`` transport, which needs no disk.
    """
    from forge.staging import free_space

    probe, free = free_space(folder)
    if free < needed:
        raise ValueError(
            f"weight_sync.transport=file needs {_gib(needed)} free under {folder} (three copies of the "
            f"published weights) but {probe} has {_gib(free)} free; set weight_sync.dir to a folder with "
            f"room (or enlarge /dev/shm, e.g. docker --shm-size), or use weight_sync.transport=message"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def apply_cpu_sampler_fix() -> None:
    """On CPU, replace vLLM's compiled rank kernel with the same expression run eagerly.

    vLLM's sampler computes the rank of each sampled token with a ``torch.compile``d
    ``batched_count_greater_than`` whenever logprobs are requested. On CPU the first call
    compiles C++ with inductor, which takes seconds even with a warm cache. The eager
    expression is identical and costs next to nothing for our batch sizes. On a GPU the compiled kernel is
    kept, so this is a no-op there.
    """
    if torch.cuda.is_available():
        return
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = _count_at_least


def _count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row, how many entries of ``x`` are >= ``values`` (vLLM's rank, eager)."""
    return (x >= values).sum(-1)


def weights_fingerprint(tensors: Iterable[torch.Tensor]) -> tuple[float, float]:
    """(sum, sum of squares) of every element of ``tensors``, in float64: a fingerprint of a
    model's weights that does not depend on how they are sharded or ordered (a trainer's
    published weights against a checkpoint's), up to float64 rounding. Any training step changes
    it. Not for what a vLLM engine holds: its CPU backend repacks the linear layers' weights."""
    total, squares = 0.0, 0.0
    for t in tensors:
        t = t.detach().to(torch.float64)
        total += float(t.sum())
        squares += float(t.square().sum())
    return total, squares


class WeightSyncExtension:
    """vLLM worker extension: forge's RPCs that run inside each worker (weight loads, CPU fix).

    Names carry the ``forge_`` prefix because vLLM refuses an extension attribute that the
    worker class already has.
    """

    def forge_apply_cpu_sampler_fix(self) -> None:
        """Run ``apply_cpu_sampler_fix`` in this worker's process (the sampler runs here)."""
        apply_cpu_sampler_fix()

    def forge_load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Load checkpoint-format tensors in place (in-process engines); return the count."""
        bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
        if bad:
            # Checked again here: a reload that fails halfway leaves the model unusable.
            raise ValueError(f"state_dict[{bad[0]!r}] is not a torch.Tensor")
        weights = dict(state_dict)
        tied = checkpoint_ties_embeddings(self.model_config)
        if tied and TIED_EMBEDDING in weights:
            weights[TIED_HEAD] = weights[TIED_EMBEDDING]
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        return len(weights)

    def forge_load_safetensors(self, blob: bytes) -> int:
        """Load weights serialised with ``safetensors.torch.save`` (engines in another process)."""
        from safetensors.torch import load

        return self.forge_load_state_dict(load(blob))
