"""What a trainer is told: the optimizer's settings, the GRPO loss's, and what the run decides.

``OptimizerSettings`` hold for any loss (SFT uses them alone); ``GRPOLossSettings`` are the GRPO
loss's knobs; ``TrainerSettings`` is both, as an app's ``trainer`` section embeds them; and
``TrainerConfig`` adds what the run decides (the model, the seed, the sampler's temperature,
where checkpoints go, the run's length). The actor is ``forge.actors.trainer.Trainer``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from forge.losses.grpo import check_loss_type
from forge.models.lora import LoraSettings

__all__ = [
    "HEADS",
    "LR_SCHEDULES",
    "DPOSettings",
    "GRPOLossSettings",
    "OptimizerSettings",
    "TrainerConfig",
    "TrainerSettings",
]

LR_SCHEDULES = ("constant", "linear", "cosine")
HEADS = ("lm", "scalar")


@dataclass(kw_only=True)
class OptimizerSettings:
    """The trainer's optimizer, schedule and numerics, whatever the loss: what a user tunes for
    SFT and GRPO alike (an app's config embeds it)."""

    lr: float = 1e-3
    """AdamW learning rate (the peak, after ``warmup_steps``)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Optimizer steps over which the learning rate rises linearly from ~0 to ``lr``."""
    lr_schedule: str = "constant"
    """After warmup: ``constant``, or ``linear``/``cosine`` decay to 0 at the run's last step."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    pack_sequences: bool = False
    """Pack each micro-batch's sequences into rows (first-fit decreasing, attention kept inside
    each sequence: ``forge.models.pack_rows``) instead of right-padding every sequence to the
    longest: the forward and backward compute almost no padding. Same loss and gradients to
    float rounding. ``padding_fraction`` is logged either way."""
    pack_row_tokens: int = 0
    """Length of a packed row (at least the longest sequence); 0: twice the micro-batch's longest."""
    logprob_chunk_tokens: int = 512
    """Tokens whose logits are computed at once (``forge.models.padded_token_logprobs``): the
    full ``[B, T, V]`` logits never exist, so memory grows with this, not with the batch."""
    micro_batch_size: int = 0
    """Sequences per forward/backward pass on each rank (gradients accumulate); 0 means the
    rank's whole slice of the batch."""
    dtype: str = "float32"
    """Dtype of the trained weights."""
    publish_dtype: str | None = None
    """Dtype of the weights sent to the policy (e.g. ``bfloat16``); None keeps ``dtype``."""
    num_threads: int = 0
    """CPU threads for torch in each rank; 0 keeps torch's default."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep; older ones are deleted after each save."""
    async_checkpoint: bool = True
    """Write checkpoints in the background: ``save_checkpoint`` returns once the state is copied
    to memory, and the files are written while training goes on (one checkpoint in flight; the
    next save, a load or the stop waits for it). False: the save returns when it is in place."""
    dist_backend: str | None = None
    """torch.distributed backend when ``procs > 1``: None picks ``nccl`` on GPUs, ``gloo`` on CPU."""
    dist_timeout_s: float = 300.0
    """Longest the ranks wait for each other (rendezvous and every collective)."""
    reshard_after_forward: bool = True
    """FSDP2: free each layer's gathered weights after its forward (gather them again for the
    backward). False gathers once per micro-batch: less communication, more memory in a step."""

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass(kw_only=True)
class GRPOLossSettings:
    """The GRPO loss's knobs (``forge.losses.grpo_loss``); SFT has none of them."""

    clip_eps: float = 0.2
    """PPO clip range of the importance ratio (below 1)."""
    clip_eps_high: float | None = None
    """Upper clip range (DAPO's clip-higher); None means ``clip_eps``."""
    beta: float = 0.04
    """Weight of the k3 KL to the reference model (0 leaves the KL out of the loss)."""
    dual_clip: float | None = None
    """Dual-clip bound (> 1, e.g. 3; verl's ``clip_ratio_c``): for a negative advantage a token's
    loss is at most ``dual_clip * |A|``, however far vLLM's logprob is below the trainer's.
    None: off. See ``forge.losses.grpo``."""
    tis_cap: float | None = None
    """Truncated importance sampling (> 0, e.g. 2; TRL's and verl's vLLM correction): each
    token's loss is weighted by ``min(exp(trainer - behaviour logprob), tis_cap)``. None: off."""
    mask_truncated: bool = False
    """Leave completions cut at ``policy.max_tokens`` (``finish_reason`` length) out of the loss."""
    loss_type: str = "grpo"
    """How per-token losses are aggregated over the whole step's batch (``forge.losses.grpo_loss``):
    ``grpo``: the mean over sequences of each sequence's token mean (every sequence weighs the
    same); ``dapo``: the mean over all trained tokens (every token weighs the same, so long
    responses weigh more); ``dr_grpo``: the sum over trained tokens / (all the batch's sequences
    x ``max_response_tokens``, the app's ``policy.max_tokens``), a constant, so no response
    length enters the normaliser. The KL term and the logged ``loss``/``pg_loss``/``kl_loss``
    are normalised the same way; ``kl``, ``clip_fraction`` and the ratio stats stay token means."""


@dataclass(kw_only=True)
class DPOSettings:
    """DPO's knobs (``forge.losses.dpo_loss``), for ``Trainer.preference_step`` on a causal LM."""

    dpo_beta: float = 0.1
    """How far the trained model may move from the reference: the implicit reward's scale."""
    dpo_loss: str = "sigmoid"
    """``sigmoid`` (DPO's Bradley-Terry on the implicit rewards) or ``ipo``."""

    def __post_init__(self) -> None:
        from forge.losses import DPO_LOSSES

        if self.dpo_loss not in DPO_LOSSES:
            raise ValueError(f"dpo_loss must be one of {', '.join(DPO_LOSSES)}, got {self.dpo_loss!r}")
        if self.dpo_beta <= 0:
            raise ValueError(f"dpo_beta must be > 0, got {self.dpo_beta}")


@dataclass(kw_only=True)
class TrainerSettings(GRPOLossSettings, OptimizerSettings):
    """Everything a user tunes in a GRPO trainer: the optimizer's settings and the loss's."""

    lora: LoraSettings | None = None
    """Train a LoRA adapter (``forge.models.lora``: rank, alpha, dropout, target_modules) over
    the frozen model instead of every weight; None (null): full fine-tuning. The optimizer,
    checkpoints and weight sync then hold the adapter alone."""


@dataclass(kw_only=True)
class TrainerConfig(TrainerSettings, DPOSettings):
    """Everything the trainer needs: its settings plus what the run decides (model, seed, the
    sampler's temperature, where checkpoints go, the model's head)."""

    model_path: str
    """Hugging Face checkpoint folder to start from (the policy's version 0)."""
    temperature: float = 1.0
    """The sampler's temperature: logprobs are computed at it."""
    pad_id: int = 0
    """Token id used for padding (masked out)."""
    seed: int = 0
    """Torch seed of each rank."""
    stop_token_ids: list[int] = field(default_factory=list)
    """The policy's stop tokens: a response trains up to its first one, inclusive."""
    checkpoint_dir: str | None = None
    """Where ``save_checkpoint`` writes full checkpoints (``<dir>/step_<N>``); None disables it."""
    max_response_tokens: int = 0
    """The most trained tokens one response can have (the sampler's ``max_tokens``; per turn
    times turns for multi-turn): ``loss_type`` ``dr_grpo``'s constant length, needed (> 0) there."""
    total_steps: int = 0
    """The run's optimizer steps: where ``linear``/``cosine`` schedules reach 0 (needed, > 0, there)."""
    head: str = "lm"
    """``lm``: the causal LM (GRPO, SFT, DPO); ``scalar``: a reward model, ``transformers``'
    sequence-classification head with one output over the same checkpoint (a head that is not in
    the checkpoint starts random), trained by ``preference_step`` with the Bradley-Terry loss."""
    ref_from_base: bool = False
    """With ``lora``: the loss's reference logprobs are the frozen base's, computed here with the
    adapter off, and the episodes' ``ref_logprobs`` are not read (no reference model runs)."""
    value_clip: float | None = 0.2
    """A critic's (``value_step``) value clipping: how far one update may move a value from the
    batch's old values before the clipped error counts (``forge.losses.ppo.value_loss``); None: off."""

    def __post_init__(self) -> None:
        TrainerSettings.__post_init__(self)
        DPOSettings.__post_init__(self)
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {', '.join(HEADS)}, got {self.head!r}")
        if self.head == "scalar" and (self.lora is not None or self.pack_sequences):
            raise ValueError(
                "a scalar head (a reward model) trains every weight, right-padded: "
                "set lora null and pack_sequences false"
            )
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip must be > 0 (or None: no clipping), got {self.value_clip}")
        if self.ref_from_base and self.lora is None:
            raise ValueError("ref_from_base needs lora: without an adapter the trained model has no frozen base")
        check_loss_type(self.loss_type, self.max_response_tokens)
        if self.lr_schedule != "constant" and self.total_steps < 1:
            raise ValueError(f"lr_schedule {self.lr_schedule!r} needs total_steps >= 1, got {self.total_steps}")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (1-based): linear warmup, then the schedule."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
        if self.lr_schedule == "linear":
            return self.lr * (1.0 - progress)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
