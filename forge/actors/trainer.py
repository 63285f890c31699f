"""``Trainer``: a ``transformers`` causal LM trained with the GRPO loss, publishing versioned weights.

One trainer is ONE actor mesh of ``procs`` ranks (SPMD): with more than one, the ranks form a
torch.distributed process group (``forge.distributed``: gloo on CPU, NCCL on GPUs) and the model
is sharded with FSDP2 per decoder layer, so each rank holds about ``1/procs`` of the parameters,
gradients and optimizer state. Every rank gets every call; ``call_spmd`` makes that one call and
returns rank 0's answer::

    trainer = await Trainer.options(procs=2).as_actor(TrainerConfig(model_path=...))
    metrics = await call_spmd(trainer.train_step, batch)         # EpisodeBatch: one optimizer step
    state_dict, version = await call_spmd(trainer.weights)       # full tensors, gathered once
    await policy.update_weights.fanout(state_dict, version)
    await call_spmd(trainer.save_checkpoint, step, {"dataset_position": n})   # every N steps
    step, version, extra = await call_spmd(trainer.load_checkpoint, path)    # on --resume
    await call_spmd(trainer.export_model, "outputs/final_model")   # a Hugging Face folder

A step splits the batch: rank ``r`` trains on the ``r``-th of ``procs`` equal slices, in
micro-batches of ``micro_batch_size`` with gradient accumulation. The loss is normalised by the
*global* counts (trained sequences, trained tokens or all sequences, as ``loss_type`` says;
tokens for the token means among the statistics), so the update and the logged statistics
equal a one-rank step on the whole batch; gradients are summed across ranks and clipped on
their global norm.

The trainer's logprobs are ``log_softmax(logits / temperature)`` at the sampler's temperature,
the same quantity vLLM reports as ``processed_logprobs``, so the importance ratio against the
behaviour logprobs is exactly 1 for on-policy data. ``version`` counts optimizer steps: the
initial weights are version 0, and the weights after step ``k`` are version ``k``.

Checkpoints (``forge.checkpoint``, torch.distributed.checkpoint) are complete for the trainer:
weights, optimizer state (each rank writes its shard), step, policy version and every rank's RNG
states, so a resumed trainer with the same number of ranks takes exactly the step the killed one
would have taken on the same batch. They load into another number of ranks too. The caller adds
its own state as ``extra``.

With ``TrainerConfig.lora`` the model is a PEFT model over the frozen checkpoint
(``forge.models.lora``, injected before sharding): the optimizer, the checkpoints and the
published weights hold the adapter alone, ``export_model`` writes the merged model and the
adapter, and with ``ref_from_base`` the loss's reference is the base with the adapter off
(``forge.actors.trainer_lora``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from forge import checkpoint
from forge.actors.trainer_batches import (
    batch_logprobs,
    counts,
    forward_token_counts,
    laid_out,
    pair_logprobs,
    trained_tokens,
)
from forge.actors.trainer_config import GRPOLossSettings, OptimizerSettings, TrainerConfig, TrainerSettings
from forge.controller import ForgeActor, endpoint
from forge.distributed import (
    SpmdRank,
    all_reduce_max,
    all_reduce_sum,
    full_state_dict,
    gather_objects,
    init_spmd,
    local_state_bytes,
    shard_model,
    shutdown_spmd,
    side_group,
)
from forge.losses import grpo_loss, sft_loss
from forge.losses.grpo import LOSS_NORMALISERS
from forge.models import PaddedBatch, right_pad
from forge.models.export import TIED_HEAD, write_hf_folder
from forge.packing import Packed
from forge.types import EpisodeBatch, PreferenceBatch, SFTBatch

if TYPE_CHECKING:
    from forge.actors.trainer_lora import AdapterFolders
    from forge.generation.weight_files import WeightFiles

__all__ = ["GRPOLossSettings", "OptimizerSettings", "Trainer", "TrainerConfig", "TrainerSettings"]
# The settings are re-exported here: ``forge.actors.trainer`` is where users look for them.

logger = logging.getLogger("forge.trainer")

# Statistics that are means over tokens; ``*_max`` ones are maxima; the rest (``loss``,
# ``pg_loss``, ``kl_loss``) are normalised like the loss, as ``loss_type`` says.
_TOKEN_MEANS = frozenset({"kl", "clip_fraction", "ratio_mean", "mismatch_mean", "value_clip_fraction", "value_mean"})

B = TypeVar("B", bound=Packed)  # a step's batch: EpisodeBatch (GRPO), SFTBatch (SFT, eval), PreferenceBatch


def _check_batch(batch: Any, kind: type[Packed], endpoint_name: str, how: str) -> None:
    """A clear error for a step's batch of the wrong type, empty, or whose fields disagree."""
    if not isinstance(batch, kind):
        raise TypeError(f"Trainer.{endpoint_name} takes one {kind.__name__} ({how}), got {type(batch).__name__}")
    if len(batch) == 0:
        raise ValueError(f"Trainer.{endpoint_name} needs at least one example, got none")
    batch.check()


class Trainer(ForgeActor):
    """Holds the model and optimizer (sharded over the mesh's ranks); ``train_step``, ``weights``,
    ``publish_weights``, ``save_checkpoint``, ``load_checkpoint``, ``export_model``."""

    # -- configuration
    config: TrainerConfig
    # -- model state, built in setup
    rank: SpmdRank
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    # -- training state
    version: int
    _weight_files: WeightFiles | AdapterFolders | None

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.version = 0
        self.device = torch.device("cpu")
        self._weight_files = None
        self._checkpoint: checkpoint.PendingCheckpoint | None = None  # the one being written
        self._checkpoint_group: Any = None  # its background collectives' own group (None: one rank, none)

    @endpoint
    async def setup(self) -> None:
        from transformers import AutoModelForCausalLM

        cfg = self.config
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.rank = await init_spmd(cfg.dist_backend, cfg.dist_timeout_s)
        if cfg.checkpoint_dir is not None and cfg.async_checkpoint:
            self._checkpoint_group = side_group(self.rank)
        self.device = self.rank.device
        torch.manual_seed(cfg.seed)
        if cfg.head == "scalar":  # a reward model: the checkpoint under a one-output classification head
            from forge.actors.trainer_pairs import scalar_head_model

            model = scalar_head_model(cfg.model_path, getattr(torch, cfg.dtype), cfg.pad_id)
        else:
            model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=getattr(torch, cfg.dtype))
        if cfg.lora is not None:  # before sharding: FSDP2 shards each layer with its adapter
            from forge.models.lora import inject

            model = inject(model, cfg.lora, cfg.model_path)
        self.model = shard_model(model.to(self.device).train(), self.rank, cfg.reshard_after_forward)
        trained = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA, the adapter alone
        self.optimizer = torch.optim.AdamW(trained, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)

    @endpoint
    async def train_step(self, batch: EpisodeBatch) -> dict[str, float]:
        """One GRPO optimizer step on the batch (this rank trains on its slice); returns the
        global loss statistics and the new version."""
        _check_batch(batch, EpisodeBatch, "train_step", "EpisodeBatch.pack(episodes)")
        return self._step(batch, self._pack, self._loss, LOSS_NORMALISERS[self.config.loss_type])

    @endpoint
    async def sft_step(self, batch: SFTBatch) -> dict[str, float]:
        """One supervised optimizer step: the mean negative log-likelihood of every answer token
        of the batch (prompt tokens are masked out), at temperature 1. Returns ``loss`` (that
        mean), ``tokens`` and the step's other statistics, as ``train_step``."""
        _check_batch(batch, SFTBatch, "sft_step", "SFTBatch.pack(examples)")
        return self._step(batch, self._pack_sft, self._sft_loss, "tokens")

    @endpoint
    async def eval_loss(self, batch: SFTBatch) -> dict[str, float]:
        """The mean negative log-likelihood of the answer tokens of ``batch`` (held-out data), in
        micro-batches, without a gradient or a step: ``{"loss": ..., "tokens": ...}``."""
        _check_batch(batch, SFTBatch, "eval_loss", "SFTBatch.pack(examples)")
        total = tokens = 0.0
        self.model.eval()
        with torch.no_grad():
            for micro in self._my_micro_batches(batch):
                packed = self._pack_sft(micro)
                loss, _ = self._sft_loss(micro, packed)
                n = float(packed.loss_mask.sum())
                total, tokens = total + float(loss) * n, tokens + n
        self.model.train()
        sums = all_reduce_sum({"nll": total, "tokens": tokens}, self.rank)
        return {"loss": sums["nll"] / max(sums["tokens"], 1.0), "tokens": sums["tokens"]}

    @endpoint
    async def preference_step(self, batch: PreferenceBatch) -> dict[str, float]:
        """One optimizer step on preference pairs: a scalar head's Bradley-Terry loss (a reward
        model, ``head: scalar``) or, on a causal LM, DPO's loss against the pairs' reference
        logprobs (``dpo_beta``, ``dpo_loss``). Returns the loss and the pairs' means of
        ``accuracy`` and ``margin`` (``forge.losses.preference``), with the step's statistics."""
        _check_batch(batch, PreferenceBatch, "preference_step", "PreferenceBatch.pack(examples)")
        return self._step(batch, self._pack_pairs, self._pair_loss, "rows")

    @endpoint
    async def preference_eval(self, batch: PreferenceBatch) -> dict[str, float]:
        """``preference_step``'s loss and statistics on held-out pairs, without a gradient or a
        step: ``{"loss", "accuracy", "margin", ...}``, each a mean over the pairs."""
        _check_batch(batch, PreferenceBatch, "preference_eval", "PreferenceBatch.pack(examples)")
        sums: dict[str, float] = {"pairs": 0.0}
        self.model.eval()
        with torch.no_grad():
            for micro in self._my_micro_batches(batch):
                loss, stats = self._pair_loss(micro, self._pack_pairs(micro))
                n = float(len(micro))
                for name, value in {"loss": loss, **stats}.items():
                    sums[name] = sums.get(name, 0.0) + float(value) * n
                sums["pairs"] += n
        self.model.train()
        sums = all_reduce_sum(sums, self.rank)
        pairs = max(sums.pop("pairs"), 1.0)
        return {name: total / pairs for name, total in sums.items()}

    @endpoint
    async def value_step(self, batch: EpisodeBatch) -> dict[str, float]:
        """One critic optimizer step (``head: scalar``, PPO's value function): the clipped value
        loss (``value_clip``) of the batch's trained tokens against its ``returns``, anchored at its
        ``values``, a token mean. Returns ``loss``, ``value_clip_fraction``, ``value_mean`` and the
        step's statistics."""
        self._need_scalar_head("value_step")
        _check_batch(batch, EpisodeBatch, "value_step", "EpisodeBatch with returns and values")
        return self._step(batch, self._pack, self._critic_loss, "tokens")

    @endpoint
    async def token_values(self, batch: EpisodeBatch) -> torch.Tensor:
        """The critic's value of every response token of ``batch``, flat like ``response_ids``
        (float32): each rank scores its slice without a gradient, and the slices are gathered."""
        from forge.actors.trainer_values import position_values

        self._need_scalar_head("token_values")
        _check_batch(batch, EpisodeBatch, "token_values", "EpisodeBatch.concat(groups)")
        mine: list[torch.Tensor] = []
        self.model.eval()
        with torch.no_grad():
            for micro in self._my_micro_batches(batch):
                padded = self._pack(micro)
                values = position_values(self.model, padded, self.device)
                mine.append(values[padded.response_mask.to(self.device)].cpu())
        self.model.train()
        return torch.cat([torch.cat(part) for part in gather_objects(mine, self.rank)])

    def _need_scalar_head(self, endpoint_name: str) -> None:
        if self.config.head != "scalar":
            raise ValueError(f"Trainer.{endpoint_name} is a critic's: it needs head 'scalar', got {self.config.head!r}")

    def _critic_loss(self, batch: EpisodeBatch, padded: PaddedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from forge.actors.trainer_values import critic_loss

        return critic_loss(self.model, batch, padded, self.device, self.config)

    def _pack_pairs(self, batch: PreferenceBatch) -> PaddedBatch:
        from forge.actors.trainer_pairs import pair_rows

        return pair_rows(batch, self.config.pad_id)

    def _pair_loss(self, batch: PreferenceBatch, padded: PaddedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from forge.actors.trainer_pairs import pair_loss

        return pair_loss(self.model, batch, padded, self.device, self.config)

    def _my_micro_batches(self, batch: B) -> list[B]:
        """This rank's equal slice of a step's batch, in micro-batches of ``micro_batch_size``
        (views of the flat tensors: nothing is unpacked or copied)."""
        world, rank = self.rank.world_size, self.rank.rank
        if len(batch) % world:
            raise ValueError(
                f"a step got {len(batch)} examples, which {world} ranks cannot split evenly; "
                "send a multiple of the trainer's ranks (procs x hosts)"
            )
        share = len(batch) // world
        return batch.rows(rank * share, (rank + 1) * share).chunks(self.config.micro_batch_size or share)

    def _step(
        self,
        batch: B,
        pack: Callable[[B], PaddedBatch],
        loss_fn: Callable[[B, PaddedBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]],
        normaliser: str,
    ) -> dict[str, float]:
        """One optimizer step of any loss: this rank's slice in micro-batches, each micro-batch's
        loss weighted by its share of the global ``normaliser`` count (``trainer_batches.counts``), so that the
        sum over micro-batches and ranks is the loss one rank would compute on the whole batch."""
        cfg = self.config
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Every rank runs the same number of micro-batches: FSDP's collectives must pair up.
        micro = self._my_micro_batches(batch)
        padded = [pack(m) for m in micro]
        local = {**counts(padded), **forward_token_counts(padded, cfg.pack_sequences, cfg.pack_row_tokens)}
        totals_of = all_reduce_sum(local, self.rank)  # the whole batch's, as one rank would see it
        totals: dict[str, float] = {}
        maxima: dict[str, float] = {}
        for items, packed in zip(micro, padded):
            loss, stats = loss_fn(items, packed)
            own = counts([packed])
            loss_weight = own[normaliser] / max(totals_of[normaliser], 1.0)
            tok_weight = own["tokens"] / max(totals_of["tokens"], 1.0)
            (loss * loss_weight).backward()  # summed over micro-batches and ranks: the global loss
            for name, value in {"loss": loss.detach(), **stats}.items():
                if name.endswith("_max"):
                    maxima[name] = max(maxima.get(name, float("-inf")), float(value))
                    continue
                weight = tok_weight if name in _TOKEN_MEANS else loss_weight
                totals[name] = totals.get(name, 0.0) + weight * float(value)
        totals = {**all_reduce_sum(totals, self.rank), **all_reduce_max(maxima, self.rank)}
        grad_norm = self._clip_gradients()
        lr = cfg.lr_at(self.version + 1)  # from the step count alone: a resumed run needs no scheduler state
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.version += 1
        return {
            **totals,
            "grad_norm": grad_norm,
            "tokens": totals_of["tokens"],
            # Pad tokens / all tokens the forward passes computed (near 0 with pack_sequences).
            "padding_fraction": 1.0 - totals_of["forward_real_tokens"] / max(totals_of["forward_tokens"], 1.0),
            "train_s": time.perf_counter() - t0,
            # This process's CPU time (rank 0's): the work a rank did, whatever else shares the cores.
            "train_cpu_s": time.process_time() - cpu0,
            "lr": lr,
            "policy_version": float(self.version),
        }

    def _clip_gradients(self) -> float:
        """Clip on the global norm of all gradients (FSDP2's sharded grads are DTensors: the norm
        is reduced over the ranks) and return that norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.config.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def _pack(self, batch: EpisodeBatch) -> PaddedBatch:
        """One micro-batch padded once, from its flat tensors; its loss mask is ``trained_tokens``'."""
        cfg = self.config
        padded = right_pad(batch.prompt_ids, batch.prompt_lens, batch.response_ids, batch.response_lens, cfg.pad_id)
        trained = trained_tokens(batch, cfg.stop_token_ids, cfg.mask_truncated)
        padded.loss_mask = laid_out(trained, padded.response_mask)
        return padded

    def _loss(self, batch: EpisodeBatch, padded: PaddedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """GRPO loss of one micro-batch, normalised by its own count (``LOSS_NORMALISERS``);
        per-token inputs are laid out like the logprobs."""
        cfg = self.config
        mask = padded.response_mask.to(self.device)  # [B, L-1]
        logprobs = batch_logprobs(self.model, padded, mask, self.device, cfg)  # [B, L-1]
        # Outside the mask, behaviour and reference equal the current logprobs (ratio 1, KL 0), so
        # no pad position can overflow exp() and poison the masked sums with inf * 0.
        behaviour = logprobs.detach().clone()
        behaviour[mask] = batch.behaviour_logprobs.to(self.device, logprobs.dtype)
        if cfg.ref_from_base:  # the frozen base, the adapter off: the reference without a reference model
            reference = torch.where(mask, self._base_logprobs(padded, mask), logprobs.detach())
        else:
            reference = logprobs.detach().clone()
            reference[mask] = batch.ref_logprobs.to(self.device, logprobs.dtype)
        if batch.token_advantages is not None:  # PPO's, one per token (forge.losses.ppo.gae)
            advantages = laid_out(batch.token_advantages, padded.response_mask).to(self.device, logprobs.dtype)
        else:
            advantages = batch.advantages.to(self.device, logprobs.dtype)
        return grpo_loss(
            logprobs,
            behaviour,
            reference,
            advantages,
            padded.loss_mask.to(self.device),  # a multi-turn episode's environment tokens are out
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            beta=cfg.beta,
            dual_clip=cfg.dual_clip,
            tis_cap=cfg.tis_cap,
            loss_type=cfg.loss_type,
            max_response_tokens=cfg.max_response_tokens,
        )

    def _base_logprobs(self, batch: PaddedBatch, mask: torch.Tensor) -> torch.Tensor:
        """The frozen base model's logprobs of ``batch`` (the adapter off), laid out as the loss's."""
        from forge.actors.trainer_lora import base_logprobs

        return base_logprobs(self.model, batch, mask, self.device, self.config)

    @endpoint
    async def reference_logprobs(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Per-token logprobs of each ``(prompt_ids, response_ids)`` under the frozen base (LoRA
        only: the adapter off), the loss's reference with ``ref_from_base``. Every rank scores
        every pair (the forward's collectives pair up)."""
        from forge.actors.trainer_lora import pair_base_logprobs

        if self.config.lora is None:
            raise ValueError("reference_logprobs needs a LoRA trainer (trainer.lora): the base is the reference")
        return pair_base_logprobs(self.model, pairs, self.device, self.config)

    def _pack_sft(self, batch: SFTBatch) -> PaddedBatch:
        return right_pad(batch.prompt_ids, batch.prompt_lens, batch.answer_ids, batch.answer_lens, self.config.pad_id)

    def _sft_loss(self, examples: SFTBatch, batch: PaddedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean NLL of one micro-batch's answer tokens, at temperature 1 (the data's own
        distribution, whatever the sampler's temperature)."""
        cfg = self.config
        mask = batch.response_mask.to(self.device)
        logprobs = batch_logprobs(self.model, batch, mask, self.device, cfg, temperature=1.0)
        return sft_loss(logprobs, batch.loss_mask.to(self.device))

    @endpoint
    async def weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """The current weights (checkpoint names, full CPU tensors) and their version.

        The shards are gathered once, into rank 0, which answers with the tensors; other ranks
        answer ``{}``. A tied ``lm_head.weight`` is left out (the policy restores it from the
        embedding).
        """
        return self._state_dict(), self.version

    @endpoint
    async def probe_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per-token logprobs of each ``(prompt_ids, response_ids)`` under the current weights at
        the sampler's temperature: what a policy replica serving them gives (``Policy.probe``).
        Every rank scores every pair (the forward's collectives pair up)."""
        tensors = [(torch.tensor(p, dtype=torch.long), torch.tensor(r, dtype=torch.long)) for p, r in pairs]
        return [row.float().tolist() for row in pair_logprobs(self.model, tensors, self.device, self.config)]

    @endpoint
    async def weights_fingerprint(self) -> tuple[float, float] | None:
        """``forge.generation.weight_sync.weights_fingerprint`` of the weights ``weights`` gives
        (rank 0; None on other ranks): what a policy replica that loaded them holds."""
        from forge.generation.weight_sync import weights_fingerprint

        state = self._state_dict()
        return weights_fingerprint(state.values()) if self.rank.is_main else None

    @endpoint
    async def publish_weights(self, folder: str) -> tuple[str, int]:
        """Write the weights into a safetensors file under ``folder``; return (path, version).

        On one host, with ``folder`` in ``/dev/shm``, this hands the policy a file to map
        instead of a message to deserialise. Rank 0 writes it (other ranks return ``""``). The
        files are kept and rewritten in place (``forge.generation.weight_files``): a fresh file
        per version cost as much as vLLM's reload. On the first call the files of trainers that
        were killed (their process is gone) are removed.
        """
        from forge.generation.weight_files import WeightFiles, remove_orphaned_weight_files

        state = self._state_dict()
        if not self.rank.is_main:
            return "", self.version
        if self.config.lora is not None:  # one PEFT adapter folder per version
            return self._adapter_folders(folder).write(state, self.version), self.version
        if self._weight_files is None or self._weight_files.folder != Path(folder):
            if self._weight_files is not None:
                self._weight_files.close()
            remove_orphaned_weight_files(folder)
            self._weight_files = WeightFiles(folder)
        path = self._weight_files.write({k: v.contiguous() for k, v in state.items()}, self.version)
        return path, self.version

    @endpoint
    async def save_checkpoint(self, step: int, extra: dict[str, Any] | None = None) -> str | None:
        """Save a full checkpoint of training ``step`` under ``checkpoint_dir``; return its folder.

        Every rank writes its shard of the weights and optimizer state (torch.distributed.checkpoint),
        plus ``step``, the policy version, every rank's Python/torch/CUDA RNG states and ``extra``
        (the caller's own state, e.g. its dataset position). Only the newest
        ``keep_checkpoints`` are kept. Returns None when ``checkpoint_dir`` is None.

        With ``async_checkpoint`` it returns once the state is copied to memory, before the folder
        is in place (``wait_checkpoint``); a save first waits for the one still being written.
        """
        cfg = self.config
        if cfg.checkpoint_dir is None:
            return None
        self._finish_checkpoint()
        state = checkpoint.TrainingState(step=step, policy_version=self.version, extra=dict(extra or {}))
        pending = checkpoint.start_checkpoint(
            cfg.checkpoint_dir,
            self.model,
            self.optimizer,
            state,
            keep=cfg.keep_checkpoints,
            where=self.rank,
            process_group=self._checkpoint_group,
        )
        if not cfg.async_checkpoint:
            return str(pending.wait())
        self._checkpoint = pending
        return str(pending.final)

    @endpoint
    async def wait_checkpoint(self) -> str | None:
        """Wait until the checkpoint being written in the background is in place; its folder
        (None if none was in flight). A failed write raises here."""
        return self._finish_checkpoint()

    def _finish_checkpoint(self) -> str | None:
        pending, self._checkpoint = self._checkpoint, None
        return None if pending is None else str(pending.wait())

    @endpoint
    async def load_checkpoint(self, path: str) -> tuple[int, int, dict[str, Any]]:
        """Restore the weights, optimizer state, policy version and RNG states saved at ``path``.

        The checkpoint may come from another number of ranks (it is resharded on load). Returns
        ``(step, policy_version, extra)`` for the caller to restore its own state. The
        optimizer's hyperparameters (``lr``, ``betas``, ``weight_decay``) come from this
        trainer's config, not the checkpoint, so a resumed run may change them. A checkpoint
        whose parameter names or shapes differ from the model's is a ``ValueError``.
        """
        self._finish_checkpoint()
        checkpoint.check_fits(
            path,
            checkpoint.model_shapes(self.model),  # with LoRA, the adapter's tensors alone
            f"resume with the model the checkpoint was written for (model.path is {self.config.model_path})",
        )
        state = checkpoint.load_checkpoint(path, self.model, self.optimizer, where=self.rank)
        cfg = self.config
        for group in self.optimizer.param_groups:
            group.update(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        self.version = state.policy_version
        return state.step, state.policy_version, state.extra

    @endpoint
    async def export_model(self, folder: str) -> str:
        """Write the current weights as a Hugging Face folder (config, safetensors, tokenizer) that
        ``transformers`` and vLLM load; return its path. Rank 0 writes it."""
        from forge.staging import staged_folder

        cfg = self.config
        if cfg.lora is not None:  # the merged model, and the adapter alone in <folder>/adapter
            from forge.actors.trainer_lora import export_lora

            export_lora(self.model, self.rank, cfg.lora, cfg.model_path, Path(folder))
            return folder
        state = full_state_dict(self.model, self.rank)
        if self.rank.is_main:
            with staged_folder(Path(folder), prefix=".tmp_export_") as tmp:
                write_hf_folder(self.model, state, cfg.model_path, tmp)
        return folder

    @endpoint
    async def state_bytes(self) -> int:
        """Bytes of parameters and optimizer state this rank holds (its shards)."""
        return local_state_bytes(self.model, self.optimizer)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        """Monarch's stop hook: published weight files must not outlive the run; leave the
        process group."""
        self._remove_published()
        if self._checkpoint is not None:  # a stop in order keeps the checkpoint it was writing
            try:
                self._finish_checkpoint()
            except Exception as error:
                logger.warning("the checkpoint being written when the trainer stopped failed: %s", error)
        shutdown_spmd()

    def _remove_published(self) -> None:
        if self._weight_files is not None:
            self._weight_files.close()
            self._weight_files = None

    def _adapter_folders(self, folder: str) -> Any:
        from forge.actors.trainer_lora import AdapterFolders

        if self._weight_files is None or self._weight_files.folder != Path(folder):
            self._remove_published()
            self._weight_files = AdapterFolders(folder, self.config.lora, self.config.model_path)
        return self._weight_files

    def _state_dict(self) -> dict[str, Any]:
        """Full weights on rank 0 (publish dtype, tied head left out); ``{}`` on other ranks.
        With LoRA, the adapter alone (PEFT's names): only its bytes go to the policy."""
        dtype = getattr(torch, self.config.publish_dtype) if self.config.publish_dtype else None
        if self.config.lora is not None:
            from forge.actors.trainer_lora import adapter_weights

            return adapter_weights(self.model, self.rank, dtype)
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        out = {}
        for name, tensor in full_state_dict(self.model, self.rank).items():
            if tied and name == TIED_HEAD:
                continue
            t = tensor.detach()
            if dtype is not None:
                t = t.to(dtype)
            out[name] = t.cpu()
        return out
