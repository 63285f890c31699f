"""Config sections the apps share, meaning the same in each: the model, where a role runs, the
policy, the weight sync, the outputs (and W&B), where records come from and how they are shown
to the model, how held-out evaluation samples and scores; and ``RunSections``, the base of every
app's root config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from forge.actors.policy import PolicySettings
from forge.actors.trainer_config import OptimizerSettings
from forge.controller.jobs import HostsConfig
from forge.data.datasets import DataSource


@dataclass(kw_only=True)
class RecordsSection(DataSource):
    """Question/answer records from local files (``forge.data.datasets``: jsonl/json, parquet,
    csv or a ``save_to_disk`` folder) and how their questions become prompts."""

    prompt_template: str = "{text}"
    """Format of the text sent to the policy; ``{text}`` is the record's question."""
    chat_template: bool = True
    """Wrap each prompt in the model tokenizer's chat template (a user turn, the assistant's
    turn opened), where the tokenizer has one; false: the templated text as it is."""
    make_if_missing: dict[str, Any] = field(default_factory=dict)
    """A generated task written to ``path`` when nothing is there, e.g. ``{task: addition,
    digits: 3, train_size: 200000, test_size: 2000}`` (``forge.data.arithmetic``); empty: none."""


@dataclass(kw_only=True)
class EvalData(DataSource):
    """The held-out records an evaluation scores. An empty ``path`` means the run's ``data.path``
    (with its keys and held-out fraction); the prompts are formatted as the training data's."""

    split: str = "test"
    """The held-out split: a split of the files (``test``), or ``held_out`` for the run data's
    ``held_out_fraction`` of ``train``."""


@dataclass(kw_only=True)
class EvalSamplingSection:
    """How an evaluation samples and judges each held-out prompt (``forge.evaluation``)."""

    data: EvalData = field(default_factory=EvalData)
    """The held-out records."""
    max_prompts: int = 500
    """The first this many held-out records are evaluated (all of them if fewer)."""
    samples: int = 8
    """Sampled completions per prompt for ``eval/pass@k`` and ``eval/mean@k`` (k); 0: greedy only."""
    temperature: float = 0.0
    """Temperature of the k samples; 0: the policy's ``temperature``."""
    max_tokens: int = 0
    """Most response tokens per completion; 0: the policy's ``max_tokens``."""
    correct_at: float = 1.0
    """A completion is correct (``eval/accuracy``, pass@k, mean@k) when its reward is at least this."""
    reward: dict[str, float] = field(default_factory=dict)
    """The reward functions that judge a completion (as ``reward.fns``); empty: the run's own."""

    def check(self, section: str = "eval") -> None:
        """Cross-field rules, named with the section's path."""
        if self.max_prompts < 1:
            raise ValueError(f"{section}.max_prompts must be >= 1, got {self.max_prompts}")
        if self.samples < 0:
            raise ValueError(f"{section}.samples must be >= 0 (0: greedy only), got {self.samples}")
        if self.temperature < 0:
            raise ValueError(f"{section}.temperature must be >= 0 (0: the policy's), got {self.temperature}")
        if self.max_tokens < 0:
            raise ValueError(f"{section}.max_tokens must be >= 0 (0: the policy's), got {self.max_tokens}")


@dataclass(kw_only=True)
class WandbSection:
    """The ``wandb`` sink's run (``logging.sinks`` must name ``wandb``)."""

    project: str = "forge"
    """W&B project."""
    name: str = ""
    """Run name; empty: W&B's own."""
    mode: str = ""
    """``online``, ``offline`` or ``disabled``; empty: online if W&B is configured on this machine
    (``WANDB_API_KEY``, ``wandb login``) or ``WANDB_MODE`` says so, else offline (``wandb sync``
    uploads it later)."""


@dataclass(kw_only=True)
class TinyModel:
    """The tiny random-init model made at ``model.path`` (CPU demos and tests)."""

    make_if_missing: bool = False
    """Make the tiny model at ``model.path`` when no model is there."""
    arch: str = "qwen2"
    """``qwen2`` or ``qwen3``."""
    hidden_size: int = 128
    """Model width, a multiple of 64."""
    num_layers: int = 2
    """Decoder layers."""
    seed: int = 0
    """Seed of the random init."""
    init_std: float = 0.02
    """Std of the normal weight init."""
    chat_template: bool = False
    """Give its tokenizer the Qwen chat template and its ``<|im_start|>``/``<|im_end|>`` tokens
    (chat completions of the OpenAI front door)."""


@dataclass(kw_only=True)
class ModelSection:
    path: str = MISSING
    """Hugging Face checkpoint folder shared by policy, reference and trainer (required)."""
    tiny: TinyModel = field(default_factory=TinyModel)
    """The tiny model to make at ``path`` if ``tiny.make_if_missing`` and none is there."""
    tokenizer: str = ""
    """A folder whose tokenizer the run expects (e.g. the base model an SFT checkpoint came
    from): ``path``'s own must be the same one, or the run stops at start-up naming both.
    Empty: no check beyond ``path``'s tokenizer fitting its embeddings."""


@dataclass(kw_only=True)
class Placement:
    """Where a role runs (see ``forge.controller.ActorOptions``)."""

    procs: int = 1
    """Processes per replica (on each of its hosts)."""
    num_replicas: int = 1
    """Replicas (services only)."""
    hosts: int = 1
    """Hosts per replica, from the ``hosts`` section's pool: the replica's ``procs`` processes
    run on each of them, as one SPMD mesh of ``hosts x procs`` ranks."""
    with_gpus: bool = False
    """Give each process ``gpus_per_proc`` GPUs of its own, from the visible ones that no
    role's ``gpus`` lists."""
    gpus: list[str] | None = None
    """Exactly these device ids for the role (implies ``with_gpus``), split over its replicas
    and processes. Roles may list the same ids to share GPUs, e.g. ``["0"]`` for all on one GPU."""
    gpus_per_proc: int = 1
    """GPUs each process sees; a vLLM policy with ``engine_kwargs.tensor_parallel_size: k``
    needs ``k``."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the role's processes."""


@dataclass(kw_only=True)
class OptimizerSection(Placement, OptimizerSettings):
    """A trainer section of the optimizer's settings (``forge.actors.trainer.OptimizerSettings``),
    placement and checkpointing, for a loss without knobs of its own (SFT, a reward model): the
    same trainer actor, sharding and checkpoints as GRPO's."""

    checkpoint_every: int = 0
    """Save a full checkpoint (weights, optimizer, step, RNG, data position) under
    ``<logging.output_dir>/checkpoints`` every N steps and at the last step; 0 never.
    ``--resume`` continues a killed run from the newest one."""
    export_final_model: bool = True
    """At the end, write the model as a Hugging Face folder to ``<logging.output_dir>/final_model``:
    what vLLM and the GRPO app's ``model.path`` load."""


@dataclass(kw_only=True)
class PolicySection(Placement, PolicySettings):
    """The policy's settings (``forge.actors.policy.PolicySettings``) and placement. Keep
    ``top_p`` at 1.0: the trainer's logprobs apply no nucleus mask."""

    concurrent_batches: int = 1
    """``generate`` batches in flight to one replica at once. Above 1 a new batch joins the
    engine while it generates (vLLM batches them step by step) instead of waiting for the batch
    before it to finish, its longest completion included: what lets ``weight_sync.mode``
    ``in_flight`` and ``rolling`` keep a replica busy through an update."""


@dataclass(kw_only=True)
class WeightSyncSection:
    transport: str = "message"
    """``message``: tensors in a Monarch message via the controller; ``file``: the trainer copies
    them into one of three safetensors files it keeps under ``dir`` (same host only) and the policy
    maps that file (``forge.generation.weight_files``)."""
    dir: str | None = None
    """Folder the ``file`` transport's runs write in (the root); None: ``$XDG_RUNTIME_DIR/forge``
    when that is set, else ``/dev/shm/forge-<uid>``. It must be yours, not a symlink, and not
    writable by other users (made 0700 if missing); each run writes in a ``run-*`` folder of its
    own inside, which its policy alone loads from and which is removed when the run ends
    (``forge.generation.weight_folder``)."""
    mode: str = "drain"
    """How the policy replicas take new weights: ``drain``, each once the generation in flight
    has finished (no sequence spans two versions); ``in_flight``, between two engine steps, the
    sequences in flight going on with the new weights, each token stamped with the version that
    sampled it (``policy.keep_kv_on_update`` says whether their old KV is kept; needs
    ``policy.engine_mode: batched``; with a LoRA trainer the sequences in flight finish on the
    adapter they started with, new ones start on the new one); ``rolling``, as ``drain`` but at
    most ``max_updating`` replicas at a time, new groups routed to the replicas already on the
    newest version (``forge.controller.versions.NewestVersion``)."""
    max_updating: int = 1
    """``rolling``: how many policy replicas may load at once (at least 1, fewer than the replicas)."""

    def root(self) -> Path:
        """The folder ``dir`` names, or the default one (not checked or created here)."""
        from forge.generation.weight_folder import weight_root

        return weight_root(self.dir)


@dataclass(kw_only=True)
class LoggingSection:
    output_dir: str = "outputs/grpo"
    """Where ``metrics.jsonl``, the plot and TensorBoard events go."""
    sinks: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Metric sinks: ``jsonl`` (``metrics.jsonl``), ``tensorboard`` (if installed), ``console``
    (one log line per step)."""
    plot: bool = True
    """Write ``<output_dir>/reward_loss.png`` at the end."""
    progress_bar: bool = True
    """Show a progress bar with reward, loss and step time."""
    wandb: WandbSection = field(default_factory=WandbSection)
    """The ``wandb`` sink's project, run name and mode."""


@dataclass(kw_only=True)
class RunSections:
    """The sections of every app's root config (GRPO, SFT, eval): the seed, the checkpoint, the
    policy's vLLM engine and placement, the hosts and the outputs. An app adds its own."""

    seed: int = 0
    """Seed of the data order, the policy's sampling and the trainer."""
    model: ModelSection = field(default_factory=ModelSection)
    policy: PolicySection = field(default_factory=PolicySection)
    hosts: HostsConfig = field(default_factory=HostsConfig)
    """Machines beyond the controller's (a Slurm or Kubernetes job, running workers); with one,
    the role processes run on its hosts."""
    logging: LoggingSection = field(default_factory=LoggingSection)


@dataclass(kw_only=True)
class TrainingSections(RunSections):
    """A root config whose run trains (GRPO, SFT): how the trainer's weights reach the policy,
    and where its checkpoints go. The app's ``trainer`` section has ``checkpoint_every``."""

    weight_sync: WeightSyncSection = field(default_factory=WeightSyncSection)
    """How the trainer's weights reach the policy."""

    def __post_init__(self) -> None:
        if self.trainer.checkpoint_every < 0:
            raise ValueError(f"trainer.checkpoint_every must be >= 0 (0: never), got {self.trainer.checkpoint_every}")
        if self.weight_sync.transport not in ("message", "file"):
            raise ValueError(f"weight_sync.transport must be 'message' or 'file', got {self.weight_sync.transport!r}")
        modes = ("drain", "in_flight", "rolling")
        if self.weight_sync.mode not in modes:
            raise ValueError(f"weight_sync.mode must be one of {modes}, got {self.weight_sync.mode!r}")
        replicas, updating = self.policy.num_replicas, self.weight_sync.max_updating
        if self.weight_sync.mode == "rolling" and not (1 <= updating < replicas):
            raise ValueError(
                f"weight_sync.max_updating must be at least 1 and fewer than policy.num_replicas ({replicas}) "
                f"for a rolling update, got {updating!r}"
            )
        batches = self.policy.concurrent_batches
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"policy.concurrent_batches must be an int >= 1, got {batches!r}")
        if "jsonl" not in self.logging.sinks:
            raise ValueError(
                "logging.sinks must include 'jsonl': metrics.jsonl is the run's record and the plot's source"
            )

    @property
    def checkpoint_dir(self) -> str:
        """Where the run's checkpoints go: ``<logging.output_dir>/checkpoints``."""
        return str(Path(self.logging.output_dir) / "checkpoints")


def trainer_ranks(cfg: Any) -> int:
    """The trainer's ranks, ``hosts x procs``: what a step's batch is split between."""
    return cfg.trainer.procs * max(1, cfg.trainer.hosts)


def rank_shares(items: list[Any], cfg: Any, what: str) -> list[Any]:
    """``items`` cut to a multiple of the trainer's ranks, so each rank scores an equal share of a
    held-out batch; a split with fewer ``what`` than ranks is a ``ValueError``."""
    ranks = trainer_ranks(cfg)
    n = len(items) - len(items) % ranks
    if n == 0:
        raise ValueError(f"the held-out split has {len(items)} {what}, fewer than the trainer's {ranks} ranks")
    return items[:n]


def check_batch_run(cfg: Any, items: str, data: str) -> None:
    """The rules of a run of ``steps`` optimizer steps of ``batch_size`` ``items`` from
    ``data.path`` (SFT, the preference apps): positive sizes, an equal share per trainer rank,
    and the data named (``data`` says what it holds)."""
    for name in ("steps", "batch_size"):
        value = getattr(cfg, name)
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    ranks = trainer_ranks(cfg)
    if cfg.batch_size % ranks:
        raise ValueError(
            f"trainer.hosts x trainer.procs ({ranks}) must divide batch_size ({cfg.batch_size}): each rank "
            f"trains on an equal share of a step's {items}"
        )
    if not cfg.data.path:
        raise ValueError(f"data.path is required: {data}")


def settings(section: object, settings_cls: type) -> dict[str, Any]:
    """The fields of ``settings_cls`` (e.g. ``TrainerSettings``) as a config section holds them."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(settings_cls)}
