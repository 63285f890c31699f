"""``Trainer``: a ``transformers`` causal LM trained with the GRPO loss, publishing versioned weights.

::

    trainer = await Trainer.options(procs=1).as_actor(TrainerConfig(model_path=...))
    metrics = await trainer.train_step.call_one(batch)        # EpisodeBatch: one optimizer step
    state_dict, version = await trainer.weights.call_one()   # tensors, never lists
    await policy.update_weights.fanout(state_dict, version)
    await trainer.save_checkpoint.call_one(step, {"dataset_position": n})   # every N steps
    step, version, extra = await trainer.load_checkpoint.call_one(path)   # on --resume

The trainer's logprobs are ``log_softmax(logits / temperature)`` at the sampler's temperature,
the same quantity vLLM reports as ``processed_logprobs``, so the importance ratio against the
behaviour logprobs is exactly 1 for on-policy data. ``version`` counts optimizer steps: the
initial weights are version 0, and the weights after step ``k`` are version ``k``.

Checkpoints (``forge.checkpoint``) are complete for the trainer: weights, optimizer state, step,
policy version and this process's RNG states, so a resumed trainer takes exactly the step the
killed one would have taken on the same batch. The caller adds its own state as ``extra``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from forge import checkpoint
from forge.controller import ForgeActor, endpoint
from forge.losses import grpo_loss
from forge.models import pack_right_padded, padded_token_logprobs
from forge.types import Episode, EpisodeBatch

__all__ = ["Trainer", "TrainerConfig", "TrainerSettings"]

_TIED_HEAD = "lm_head.weight"


@dataclass(kw_only=True)
class TrainerSettings:
    """The trainer's optimizer, loss and numerics: what a user tunes (an app's config embeds it)."""

    lr: float = 1e-3
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    clip_eps: float = 0.2
    """PPO clip range of the importance ratio (below 1)."""
    clip_eps_high: float | None = None
    """Upper clip range (DAPO's clip-higher); None means ``clip_eps``."""
    beta: float = 0.04
    """Weight of the k3 KL to the reference model."""
    micro_batch_size: int = 0
    """Sequences per forward/backward pass (gradients accumulate); 0 means the whole batch."""
    dtype: str = "float32"
    """Dtype of the trained weights."""
    publish_dtype: str | None = None
    """Dtype of the weights sent to the policy (e.g. ``bfloat16``); None keeps ``dtype``."""
    num_threads: int = 0
    """CPU threads for torch; 0 keeps torch's default."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep; older ones are deleted after each save."""


@dataclass(kw_only=True)
class TrainerConfig(TrainerSettings):
    """Everything the trainer needs: its settings plus what the run decides (model, seed, the
    sampler's temperature, where checkpoints go)."""

    model_path: str
    """Hugging Face checkpoint folder to start from (the policy's version 0)."""
    temperature: float = 1.0
    """The sampler's temperature: logprobs are computed at it."""
    pad_id: int = 0
    """Token id used for padding (masked out)."""
    seed: int = 0
    """Torch seed of this process."""
    checkpoint_dir: str | None = None
    """Where ``save_checkpoint`` writes full checkpoints (``<dir>/step_<N>``); None disables it."""


class Trainer(ForgeActor):
    """Holds the model and optimizer; ``train_step``, ``weights``, ``save_checkpoint``, ``load_checkpoint``."""

    # -- configuration
    config: TrainerConfig
    # -- model state, built in setup
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    # -- training state
    version: int
    _published: list[str]
    _publish_count: int

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.version = 0
        self.device = torch.device("cpu")
        self._published = []
        self._publish_count = 0

    @endpoint
    async def setup(self) -> None:
        from transformers import AutoModelForCausalLM

        cfg = self.config
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.seed)
        if torch.cuda.is_available():
            self.device = torch.device("cuda")
        model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=getattr(torch, cfg.dtype))
        self.model = model.to(self.device).train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )

    @endpoint
    async def train_step(self, batch: EpisodeBatch | list[Episode]) -> dict[str, float]:
        """One optimizer step on the batch; returns loss statistics and the new version."""
        episodes = batch.unpack() if isinstance(batch, EpisodeBatch) else list(batch)
        if not episodes:
            raise ValueError("train_step needs at least one episode, got none")
        cfg = self.config
        t0 = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        size = cfg.micro_batch_size or len(episodes)
        totals: dict[str, float] = {}
        tokens = 0
        for start in range(0, len(episodes), size):
            chunk = episodes[start : start + size]
            weight = len(chunk) / len(episodes)
            loss, stats, n_tokens = self._loss(chunk)
            (loss * weight).backward()
            tokens += n_tokens
            for name, value in {"loss": loss.detach(), **stats}.items():
                totals[name] = totals.get(name, 0.0) + weight * float(value)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if cfg.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        self.optimizer.step()
        self.version += 1
        return {
            **totals,
            "grad_norm": float(grad_norm),
            "tokens": float(tokens),
            "train_s": time.perf_counter() - t0,
            "policy_version": float(self.version),
        }

    def _loss(self, episodes: list[Episode]) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """GRPO loss of one micro-batch; per-token inputs are laid out like the logprobs."""
        cfg = self.config
        batch = pack_right_padded([e.prompt_ids for e in episodes], [e.response_ids for e in episodes], cfg.pad_id)
        logprobs = padded_token_logprobs(
            self.model, batch.input_ids.to(self.device), batch.attention_mask.to(self.device), cfg.temperature
        )  # [B, L-1]
        mask = batch.response_mask.to(self.device)  # [B, L-1]
        # Outside the mask, behaviour and reference equal the current logprobs (ratio 1, KL 0), so
        # no pad position can overflow exp() and poison the masked sums with inf * 0.
        behaviour = logprobs.detach().clone()
        reference = logprobs.detach().clone()
        behaviour[mask] = torch.cat([e.behaviour_logprobs for e in episodes]).to(self.device, logprobs.dtype)
        reference[mask] = torch.cat([e.ref_logprobs for e in episodes]).to(self.device, logprobs.dtype)
        advantages = torch.tensor([e.advantage for e in episodes], dtype=logprobs.dtype, device=self.device)
        loss, stats = grpo_loss(
            logprobs,
            behaviour,
            reference,
            advantages,
            mask,
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            beta=cfg.beta,
        )
        return loss, stats, int(mask.sum())

    @endpoint
    async def weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """The current weights (checkpoint names, CPU tensors) and their version.

        A tied ``lm_head.weight`` is left out (the policy restores it from the embedding).
        """
        return self._state_dict(), self.version

    @endpoint
    async def publish_weights(self, folder: str) -> tuple[str, int]:
        """Write the weights as one safetensors file under ``folder``; return (path, version).

        On one host, with ``folder`` in ``/dev/shm``, this hands the policy a file to load
        instead of a message to deserialise. The previous version's file is removed, and on the
        first call so are the files of trainers that were killed (their process is gone).
        """
        from safetensors.torch import save_file

        Path(folder).mkdir(parents=True, exist_ok=True)
        if self._publish_count == 0:
            _remove_orphaned_weights(folder)
        self._publish_count += 1
        path = os.path.join(folder, f"weights-{os.getpid()}-{self._publish_count}-v{self.version}.safetensors")
        tmp = path + ".tmp"
        save_file({k: v.contiguous() for k, v in self._state_dict().items()}, tmp)
        os.replace(tmp, path)
        self._published.append(path)
        while len(self._published) > 2:  # the policy may still be reading the previous one
            stale = self._published.pop(0)
            if os.path.exists(stale):
                os.remove(stale)
        return path, self.version

    @endpoint
    async def save_checkpoint(self, step: int, extra: dict[str, Any] | None = None) -> str | None:
        """Save a full checkpoint of training ``step`` under ``checkpoint_dir``; return its folder.

        It holds the weights (safetensors, in the training dtype, Hugging Face names), the
        optimizer state, ``step``, the policy version, this process's Python/torch/CUDA RNG
        states and ``extra`` (the caller's own state, e.g. its dataset position). Only the
        newest ``keep_checkpoints`` are kept. Returns None when ``checkpoint_dir`` is None.
        """
        cfg = self.config
        if cfg.checkpoint_dir is None:
            return None
        state = checkpoint.TrainingState(
            step=step,
            policy_version=self.version,
            optimizer=self.optimizer.state_dict(),
            rng=checkpoint.capture_rng(),
            extra=dict(extra or {}),
        )
        path = checkpoint.save_checkpoint(cfg.checkpoint_dir, self.model.state_dict(), state, keep=cfg.keep_checkpoints)
        return str(path)

    @endpoint
    async def load_checkpoint(self, path: str) -> tuple[int, int, dict[str, Any]]:
        """Restore the weights, optimizer state, policy version and RNG states saved at ``path``.

        Returns ``(step, policy_version, extra)`` for the caller to restore its own state. The
        optimizer's hyperparameters (``lr``, ``betas``, ``weight_decay``) come from this
        trainer's config, not the checkpoint, so a resumed run may change them. A checkpoint
        whose parameter names or shapes differ from the model's is a ``ValueError``.
        """
        weights, state = checkpoint.load_checkpoint(path)
        self._check_fits(weights, path)
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(state.optimizer)
        cfg = self.config
        for group in self.optimizer.param_groups:
            group.update(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        checkpoint.restore_rng(state.rng)
        self.version = state.policy_version
        return state.step, state.policy_version, state.extra

    def _check_fits(self, weights: dict[str, torch.Tensor], path: str) -> None:
        own = self.model.state_dict()
        fix = f"resume with the model the checkpoint was written for (model.path is {self.config.model_path})"
        missing, unexpected = sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys())
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {path} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}; {fix}"
            )
        for name, tensor in own.items():
            if weights[name].shape != tensor.shape:
                raise ValueError(
                    f"checkpoint {path} does not fit the model: {name} is {list(weights[name].shape)} in the "
                    f"checkpoint but {list(tensor.shape)} in the model; {fix}"
                )

    @endpoint
    async def cleanup(self) -> None:
        """Remove the weight files this trainer published."""
        self._remove_published()

    async def __cleanup__(self, exc: BaseException | None) -> None:
        """Monarch's stop hook: published weight files must not outlive the run."""
        self._remove_published()

    def _remove_published(self) -> None:
        for path in self._published:
            if os.path.exists(path):
                os.remove(path)
        self._published.clear()

    def _state_dict(self) -> dict[str, Any]:
        dtype = getattr(torch, self.config.publish_dtype) if self.config.publish_dtype else None
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        out = {}
        for name, tensor in self.model.state_dict().items():
            if tied and name == _TIED_HEAD:
                continue
            t = tensor.detach()
            if dtype is not None:
                t = t.to(dtype)
            out[name] = t.cpu()
        return out


def _remove_orphaned_weights(folder: str) -> None:
    """Remove ``weights-<pid>-*`` files (and their ``.tmp``) whose writer process is gone.

    A trainer killed with SIGKILL cannot remove what it published; in ``/dev/shm`` that is
    memory held until reboot. The file transport is single-host, so the pid is this host's.
    """
    for path in Path(folder).glob("weights-*.safetensors*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
