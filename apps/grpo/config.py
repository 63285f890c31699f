"""The GRPO app's config: a tree of typed dataclasses, loaded from YAML plus ``key=value`` overrides.

Every field is documented where it is defined. ``forge.config.load_config`` checks a YAML file
and the command-line overrides against ``GRPOConfig``: an unknown key, a wrong type or a missing
required value is an error naming the full key path (e.g. ``trainer.lr``). Cross-field rules
live in ``__post_init__``.

A config is code: the ``module:attr`` names in ``reward.fns``, ``data.source`` and ``env.cls`` are
imported and run, with the user's rights, in the controller and the role processes. Run only
configs you would run as scripts (README, "What forge trusts").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apps.common.config import EvalSamplingSection, Placement, RecordsSection, TrainingSections
from forge.actors.dataset import DATASET_SOURCES
from forge.actors.trainer import OptimizerSettings, TrainerSettings

ALGORITHMS = ("grpo", "ppo")


@dataclass(kw_only=True)
class ReferenceSection(Placement):
    from_base: bool | None = None
    """The reference logprobs are the trainer's base weights with its LoRA adapter off (PEFT's
    ``disable_adapter``), so no reference replicas start; None (the default): true when
    ``trainer.lora`` is set, false otherwise. Needs ``trainer.lora``."""
    dtype: str = "float32"
    """Reference model dtype."""
    pack_sequences: bool = False
    """Pack each batch's sequences into rows instead of padding them (``forge.models.pack_rows``)."""


@dataclass(kw_only=True)
class RewardSection(Placement):
    """Where each response's reward comes from (``apps.grpo.reward_mix``): reward functions (run by
    the ``reward`` service, placed by this section) and learned reward models (the
    ``reward_model`` service), each normalised, weighted and summed."""

    fns: dict[str, float] = field(default_factory=lambda: {"toy": 1.0})
    """Reward functions (registry name or ``module:function``, imported and run) and their weights.
    Weight 0: logged (``reward/fn_<name>``, e.g. the task's checker beside a learned reward), not
    trained on."""
    models: dict[str, float] = field(default_factory=dict)
    """Reward models and their weights: folder (a scalar-head checkpoint, what ``apps.rm`` exports
    as ``final_model``) -> weight. Each response's score is logged as ``reward/model_<name>``.
    Single-turn rollouts only."""
    normalize: str = "none"
    """Each source's scores before weighting: ``none``; ``batch``, standardised over the group;
    ``running``, by the running mean and standard deviation of everything the source scored."""


@dataclass(kw_only=True)
class RewardModelSection(Placement):
    """The reward-model service of ``reward.models`` (``forge.actors.reward_model``): replicas,
    processes per replica (FSDP2 shards each model over them) and GPUs."""

    dtype: str = "float32"
    """The reward models' weights dtype."""


@dataclass(kw_only=True)
class TrainerSection(Placement, TrainerSettings):
    """The trainer's settings (``forge.actors.trainer.TrainerSettings``), placement and
    checkpointing."""

    min_hosts: int | None = None
    """Fewest hosts a replaced trainer may run on when hosts were lost: it restarts on as many
    live hosts as it can get, down to this (the checkpoint reshards to the smaller mesh, and each
    rank trains a larger share of the step); None: ``hosts`` (a trainer restarts at its own size
    or not at all)."""
    checkpoint_every: int = 0
    """Save a full checkpoint (weights, optimizer, step, policy version, RNG, dataset position)
    under ``<logging.output_dir>/checkpoints`` every N steps and at the last step; 0 never.
    ``--resume`` continues a killed run from the newest one."""
    export_final_model: bool = True
    """At the end, write the trained model as a Hugging Face folder (config, safetensors,
    tokenizer) to ``<logging.output_dir>/final_model``, for ``transformers`` and vLLM."""
    export_every: int = 0
    """Also write a Hugging Face folder every N steps, ``<logging.output_dir>/exports/step_<N>``,
    each listed with its step and wall time in ``exports/index.jsonl`` (to evaluate or compare
    checkpoints afterwards: ``apps.eval``, ``benchmarks/time_to_accuracy.py``); 0 never."""


@dataclass(kw_only=True)
class CriticSection(Placement, OptimizerSettings):
    """PPO's value function (``algorithm: ppo``): a second trainer, the policy's checkpoint under a
    new scalar head (``head: scalar``), with its own optimizer and placement. Nothing starts
    unless ``algorithm`` is ``ppo``. It is checkpointed beside the trainer, at the same steps."""

    model: str | None = None
    """The critic's starting checkpoint; None: the policy's (``model.path``)."""
    value_clip: float | None = 0.2
    """PPO's value clipping: a value moves at most this far from its prediction when the step's
    targets were made (``forge.losses.ppo.value_loss``); null: no clipping."""


@dataclass(kw_only=True)
class PPOSection:
    """PPO's advantages (``algorithm: ppo``): GAE over each response's tokens with the critic's
    values, the reward on the last trained token (``forge.losses.ppo.gae``)."""

    gamma: float = 1.0
    """Discount per token."""
    lam: float = 0.95
    """GAE's lambda: 1 is the Monte-Carlo return minus the value, 0 one-step TD."""
    whiten: bool = True
    """Standardise the step's advantages over its trained tokens."""


@dataclass(kw_only=True)
class DataSection(RecordsSection):
    """Where prompts come from. ``source: dataset`` reads records from local files (``path``,
    ``split``, ``question_key``, ``answer_key``: ``forge.data.datasets``), e.g. GSM8K's
    ``train.jsonl`` or the generated addition task."""

    source: str = "toy"
    """``toy`` (the built-in digit-reversal task), ``dataset`` (records from ``path``) or
    ``package.module:factory`` (your ``factory(seed=..., **options)`` yielding ``Prompt``s; imported
    and run)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the toy task (e.g. ``min_digits``) or of your factory."""


@dataclass(kw_only=True)
class EvalSection(EvalSamplingSection):
    """Held-out evaluation on the policy service, beside training (``forge.evaluation``): at step
    0, every ``every`` steps and after the last step. Its figures (``eval/accuracy``,
    ``eval/pass@k``, ``eval/mean@k``, ``eval/reward_mean``, ``eval/length_mean``, ``eval/s``) go
    to every sink, ``eval/step`` says which step's weights they describe."""

    every: int = 0
    """Steps between evaluations; 0: no evaluation."""


@dataclass(kw_only=True)
class RolloutSection:
    concurrency: int = 0
    """Prompts in flight at once (each one group); 0 means ``prompts_per_step``."""
    max_buffered_groups: int = 0
    """Most groups buffered or in flight before rollouts wait; 0 means
    ``prompts_per_step * max(1, max_policy_age)``: what the next ``max_policy_age`` steps can
    use. More would be evicted as stale before it trains: wasted generation."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop a finished group whose rewards are all equal (its advantages
    are all zero, so it teaches nothing) before it reaches the buffer, and keep generating until
    the step has ``prompts_per_step`` groups with a reward spread. The cost is more generation
    per step: about ``1 / (1 - zero_std_fraction)`` times as many groups (``zero_std_fraction``
    is logged every step, on or off)."""
    max_dropped_per_step: int | None = None
    """With ``dynamic_sampling``: the most uniform groups dropped per training step (counted from
    one step's log line to the next). Past it the step's further uniform groups are kept (they
    train with zero advantages) and a warning is logged once for the step, so a task where nearly
    every group is uniform still trains instead of generating forever. None (null):
    ``4 * prompts_per_step``; 0 drops none."""
    workers: int | None = None
    """Rollout worker processes that make the groups (``apps.grpo.rollout_workers``): each runs
    the policy, reward, reference (and env) requests of the groups it is sent, so the controller
    sends one request per group. null: the controller makes every group itself. Between 1 and
    the prompts in flight (``concurrency``)."""
    agent: str = ""
    """``package.module:fn``: train an agent, ``async def fn(client, prompt) -> float``, that talks to
    the policy through forge's OpenAI front door (``apps.grpo.agents``; examples in
    ``forge.envs.agents``). Empty: no agent (single-turn, or ``env.cls``'s multi-turn)."""
    agent_timeout_s: float = 120.0
    """Longest one agent episode may run; past it the episode fails alone, with a warning."""

    def __post_init__(self) -> None:
        if not self.agent_timeout_s > 0:
            raise ValueError(f"rollout.agent_timeout_s must be a number of seconds > 0, got {self.agent_timeout_s}")
        bound = self.max_dropped_per_step
        if bound is not None and bound < 0:
            raise ValueError(
                f"rollout.max_dropped_per_step must be >= 0 (or null for 4 x prompts_per_step), got {bound}"
            )


@dataclass(kw_only=True)
class FaultsSection:
    """How the rollout side (the policy, reference and reward services) outlives its processes.

    A replica whose process dies (or hangs: see ``health_timeout_s``) is restarted with backoff;
    a restarted policy replica loads the current weights before it takes traffic, and the
    groups it was generating are generated again. A trainer whose process (or one rank's) dies is
    replaced by a new mesh of the same shape, which loads the newest checkpoint; training rewinds
    to that step (``trainer_max_restarts``; ``apps/grpo/trainer_restart.py``).
    """

    max_restarts: int = 3
    """Restarts of each replica before the run gives up on its role; 0: the first death ends
    the run."""
    restart_backoff_s: float = 1.0
    """Wait before a replica's first restart; doubles with each failed try."""
    max_unhealthy_s: float = 300.0
    """Longest a role may have no healthy replica (all of them restarting) before the run gives
    up. Keep it above a replica's start time (a vLLM engine's start on GPUs)."""
    health_interval_s: float = 5.0
    """How often an idle or stalled replica is probed."""
    health_timeout_s: float = 120.0
    """A replica that answers no probe and finishes no request for this long (a hung process)
    is replaced. Keep it above the longest single batch of any role."""
    trainer_max_restarts: int | None = None
    """Replacements of a dead trainer in one run, each from the newest checkpoint; None: 1 when
    ``trainer.checkpoint_every`` > 0, else 0 (without a checkpoint there is nothing to restore)."""

    def trainer_restarts(self, checkpoint_every: int) -> int:
        """``trainer_max_restarts`` with its default resolved."""
        if self.trainer_max_restarts is None:
            return 1 if checkpoint_every > 0 else 0
        return self.trainer_max_restarts


@dataclass(kw_only=True)
class EnvSection(Placement):
    """Multi-turn rollouts: the environment service (``forge.envs``) and its limits. Leave
    ``cls`` empty for single-turn rollouts (one completion per prompt, scored by ``reward``)."""

    cls: str = ""
    """The environment as ``package.module:Class`` (a ``forge.envs.Environment`` subclass, imported
    and run), e.g. ``forge.envs.toy:ReverseWithFeedback``; empty: single-turn."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    max_turns: int = 3
    """Policy turns per trajectory; one that is not done by then fails (alone)."""
    step_timeout_s: float = 30.0
    """Longest one environment ``reset`` or ``step`` may take before its trajectory fails."""


@dataclass(kw_only=True)
class GRPOConfig(TrainingSections):
    """The whole app: GRPO settings, then one section per role (and those of every app's run,
    ``RunSections``: ``seed``, ``model``, ``policy``, ``hosts``, ``logging``, and ``weight_sync``)."""

    steps: int = 150
    """Training steps (optimizer updates)."""
    group_size: int = 8
    """Completions per prompt."""
    prompts_per_step: int = 16
    """Groups (prompts) in one training batch."""
    max_policy_age: int = 1
    """Off-by-n: a group sampled by policy version g trains at version v only if v - g <= this."""
    reference: ReferenceSection = field(default_factory=ReferenceSection)
    reward: RewardSection = field(default_factory=RewardSection)
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    """Where ``reward.models`` are served; nothing starts without them."""
    trainer: TrainerSection = field(default_factory=TrainerSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    faults: FaultsSection = field(default_factory=FaultsSection)
    env: EnvSection = field(default_factory=EnvSection)
    """The environment of multi-turn rollouts; none (single-turn) unless ``env.cls`` is set."""
    eval: EvalSection = field(default_factory=EvalSection)
    """Held-out evaluation beside training; off unless ``eval.every`` is set."""
    algorithm: str = "grpo"
    """``grpo``: each episode's advantage is its reward against its group's (``forge.losses.grpo``);
    ``ppo``: per-token advantages by GAE with a learned value function, the ``critic`` section
    (``ppo`` sets GAE's knobs). The policy's loss (clipping, KL, corrections) is the same."""
    critic: CriticSection | None = None
    """PPO's critic, which ``algorithm: ppo`` needs (``critic: {}`` takes every default); unused by GRPO."""
    ppo: PPOSection = field(default_factory=PPOSection)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "group_size", "prompts_per_step"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        episodes = self.prompts_per_step * self.group_size
        ranks = self.trainer.procs * max(1, self.trainer.hosts)  # hosts x procs ranks train together
        if self.trainer.procs < 1 or episodes % ranks:
            what = "trainer.procs" if self.trainer.hosts == 1 else "trainer.hosts x trainer.procs"
            raise ValueError(
                f"{what} ({ranks}) must divide prompts_per_step x group_size "
                f"({self.prompts_per_step} x {self.group_size} = {episodes}): each trainer rank trains on an equal "
                "share of the step's episodes"
            )
        self._check_min_hosts(episodes)
        if self.trainer.export_every < 0:
            raise ValueError(f"trainer.export_every must be >= 0 (0: never), got {self.trainer.export_every}")
        if self.trainer.keep_checkpoints < 1:
            raise ValueError(f"trainer.keep_checkpoints must be >= 1, got {self.trainer.keep_checkpoints}")
        if self.max_policy_age < 0:
            raise ValueError(f"max_policy_age must be >= 0, got {self.max_policy_age}")
        self._check_rollout_workers()
        if self.policy.top_p != 1.0:
            raise ValueError(
                f"policy.top_p must be 1.0, got {self.policy.top_p}: the trainer's logprobs "
                "do not apply a nucleus mask, so behaviour and trainer logprobs would disagree"
            )
        if not self.policy.temperature > 0:
            raise ValueError(f"policy.temperature must be > 0 for RL sampling, got {self.policy.temperature}")
        self._check_data()
        self._check_env()
        self._check_lora()
        self._check_reward()
        self._check_algorithm()
        self._check_placement()
        if self.faults.max_restarts < 0:
            raise ValueError(f"faults.max_restarts must be >= 0 (0: no restarts), got {self.faults.max_restarts}")
        restarts = self.faults.trainer_max_restarts
        if restarts is not None and (isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0):
            raise ValueError(
                f"faults.trainer_max_restarts must be an integer >= 0 (0: a dead trainer stops the run), "
                f"got {restarts!r}"
            )
        for name in ("restart_backoff_s", "max_unhealthy_s", "health_interval_s", "health_timeout_s"):
            value = getattr(self.faults, name)
            if not value > 0:
                raise ValueError(f"faults.{name} must be a number of seconds > 0, got {value}")
        if self.faults.health_timeout_s < self.faults.health_interval_s:
            raise ValueError(
                f"faults.health_timeout_s ({self.faults.health_timeout_s}) must be >= faults.health_interval_s "
                f"({self.faults.health_interval_s}): a replica is probed every interval and failed after the timeout"
            )

    def _check_reward(self) -> None:
        """The reward's sources (``apps.grpo.reward_mix.RewardSettings``), what reward models work
        with, and a checker for held-out evaluation."""
        from apps.grpo.reward_mix import RewardSettings

        r = self.reward
        RewardSettings(dict(r.fns), dict(r.models), r.normalize)
        if r.models and (self.env.cls or self.rollout.agent):
            raise ValueError(
                "reward.models scores single-turn completions; a multi-turn environment (env.cls) or an agent "
                "(rollout.agent) gives its own reward"
            )
        if self.eval.every and not self.eval.reward and not any(r.fns.values()):
            raise ValueError(
                "eval.reward is needed: the reward functions judge held-out answers, and reward.fns has none "
                "with a weight (set e.g. eval.reward: {exact_match: 1.0})"
            )

    def _check_algorithm(self) -> None:
        """``algorithm`` is a known one; PPO's knobs are in range and its critic is one it can train."""
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.algorithm != "ppo":
            return
        if self.critic is None:
            raise ValueError(
                "algorithm: ppo needs a critic section, the value function's optimizer and placement "
                "(e.g. critic: {lr: 3.0e-3, procs: 1}; critic: {} takes the defaults)"
            )
        for name in ("gamma", "lam"):
            value = getattr(self.ppo, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"ppo.{name} must be a number in [0, 1], got {value!r}")
        clip = self.critic.value_clip
        if clip is not None and not clip > 0:
            raise ValueError(f"critic.value_clip must be > 0 (or null: no clipping), got {clip!r}")
        if self.critic.pack_sequences:
            raise ValueError("critic.pack_sequences must be false: a scalar head reads right-padded rows")

    def _check_lora(self) -> None:
        """``trainer.lora`` against the policy that serves it, and the reference it implies."""
        from forge.generation.lora import serving_rank

        lora = self.trainer.lora
        if self.reference.from_base and lora is None:
            raise ValueError(
                "reference.from_base needs trainer.lora: the reference is the base with the adapter off, and "
                "a full fine-tuning trainer has no frozen base (leave reference.from_base null)"
            )
        if lora is None:
            return
        serving_rank(lora.rank, self.policy.max_lora_rank)  # a rank above policy.max_lora_rank names both
        if self.policy.engine_mode != "batched":
            raise ValueError(
                f"trainer.lora needs policy.engine_mode 'batched' (adapters are served by VllmEngine), "
                f"got {self.policy.engine_mode!r}"
            )

    @property
    def ref_from_base(self) -> bool:
        """Whether the reference is the trainer's base (``reference.from_base`` resolved)."""
        if self.reference.from_base is None:
            return self.trainer.lora is not None
        return self.reference.from_base

    def _check_min_hosts(self, episodes: int) -> None:
        t = self.trainer
        if t.min_hosts is None:
            return
        if not 1 <= t.min_hosts <= t.hosts:
            raise ValueError(f"trainer.min_hosts must be between 1 and trainer.hosts ({t.hosts}), got {t.min_hosts}")
        if episodes % (t.min_hosts * t.procs):
            raise ValueError(
                f"trainer.min_hosts x trainer.procs ({t.min_hosts} x {t.procs}) must divide prompts_per_step x "
                f"group_size ({episodes}): a trainer restarted on fewer hosts still splits the step equally"
            )

    def _check_data(self) -> None:
        source = self.data.source
        if source == "jsonl":
            raise ValueError(
                "data.source 'jsonl' is now 'dataset': records from data.path (jsonl, json, parquet, csv or a "
                "save_to_disk folder) through Hugging Face datasets"
            )
        if source not in DATASET_SOURCES and ":" not in source:
            raise ValueError(f"data.source must be 'toy', 'dataset' or 'package.module:factory', got {source!r}")
        if source == "dataset" and not self.data.path:
            raise ValueError("data.path is required when data.source is 'dataset'")
        if self.eval.every < 0:
            raise ValueError(f"eval.every must be >= 0 (0: no evaluation), got {self.eval.every}")
        if self.eval.every:
            self.eval.check()
            if not (self.eval.data.path or self.data.path):
                raise ValueError("eval needs held-out records: set eval.data.path (or data.path)")

    def _check_env(self) -> None:
        env = self.env
        if env.cls and (env.cls.count(":") != 1 or not all(env.cls.split(":"))):
            raise ValueError(f"env.cls must name an environment as 'package.module:Class', got {env.cls!r}")
        if env.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {env.max_turns}")
        if not env.step_timeout_s > 0:
            raise ValueError(f"env.step_timeout_s must be a number of seconds > 0, got {env.step_timeout_s}")
        if self.rollout.agent:
            from apps.grpo.agents import load_agent

            if env.cls:
                raise ValueError(
                    f"rollout.agent ({self.rollout.agent!r}) and env.cls ({env.cls!r}) both make the episodes; "
                    "set one of them"
                )
            load_agent(self.rollout.agent)  # a name that does not import fails here, not in the first group

    def _check_placement(self) -> None:
        """Hosts and GPUs of each role: sizes, and vLLM's tensor parallelism inside one process."""
        for role in ("policy", "reference", "reward", "reward_model", "trainer", "critic"):
            section = getattr(self, role)
            if section is None:  # no critic: GRPO
                continue
            for name in ("procs", "num_replicas", "hosts", "gpus_per_proc"):
                value = getattr(section, name)
                if value < 1:
                    raise ValueError(f"{role}.{name} must be >= 1, got {value}")
            if section.hosts > 1 and self.hosts.job == "none":
                raise ValueError(
                    f"{role}.hosts ({section.hosts}) places a replica on several hosts, which needs a hosts "
                    "section (hosts.job: slurm, kubernetes, process or attach)"
                )
            if section.hosts > self.hosts.num_hosts and self.hosts.job not in ("none", "attach"):
                raise ValueError(
                    f"{role}.hosts ({section.hosts}) is more than hosts.num_hosts ({self.hosts.num_hosts})"
                )
        tp = int(self.policy.engine_kwargs.get("tensor_parallel_size", 1))
        uses_gpus = self.policy.with_gpus or self.policy.gpus is not None
        if uses_gpus and tp != self.policy.gpus_per_proc:
            raise ValueError(
                f"policy.engine_kwargs.tensor_parallel_size ({tp}) must equal policy.gpus_per_proc "
                f"({self.policy.gpus_per_proc}): vLLM runs its tensor-parallel workers on the GPUs of its process"
            )
        self._check_numerics()

    def _check_numerics(self) -> None:
        """The loss's corrections, chunking and stops, and the reference's token budget."""
        from forge.actors.reference_model import TOKEN_BUDGET

        t = self.trainer
        if t.dual_clip is not None and not t.dual_clip > 1:
            raise ValueError(f"trainer.dual_clip must be > 1 (or null to disable it), got {t.dual_clip}")
        if t.tis_cap is not None and not t.tis_cap > 0:
            raise ValueError(f"trainer.tis_cap must be > 0 (or null to disable it), got {t.tis_cap}")
        if t.logprob_chunk_tokens < 1:
            raise ValueError(f"trainer.logprob_chunk_tokens must be >= 1, got {t.logprob_chunk_tokens}")
        self._check_loss_type()
        bad = [i for i in self.policy.stop_token_ids if i < 0]
        if bad:
            raise ValueError(f"policy.stop_token_ids must be token ids >= 0, got {bad[0]}")
        if self.policy.max_model_len > TOKEN_BUDGET:
            raise ValueError(
                f"policy.max_model_len ({self.policy.max_model_len}) exceeds the reference model's batch budget "
                f"of {TOKEN_BUDGET} tokens (forge.actors.reference_model.TOKEN_BUDGET): a longest sequence "
                "could never be scored"
            )

    def _check_loss_type(self) -> None:
        """``trainer.loss_type`` is a known one; ``dr_grpo``'s constant length is a real length."""
        from forge.losses.grpo import LOSS_TYPES

        loss_type = self.trainer.loss_type
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"trainer.loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
        if loss_type == "dr_grpo" and self.max_response_tokens < 1:
            raise ValueError(
                f"trainer.loss_type dr_grpo divides by policy.max_tokens, which must then be >= 1, "
                f"got {self.policy.max_tokens}"
            )

    @property
    def max_response_tokens(self) -> int:
        """The most trained tokens one episode can have: ``policy.max_tokens``, times
        ``env.max_turns`` for multi-turn (environment tokens are not trained), ``policy.max_model_len``
        for an agent's (its turns are its own). The trainer's constant length for ``trainer.loss_type``
        ``dr_grpo``."""
        if self.rollout.agent:
            return self.policy.max_model_len
        return self.policy.max_tokens * (self.env.max_turns if self.env.cls else 1)

    def check_weight_sync_space(self, model_dir: str | Path) -> None:
        """``apps.common.space``'s start-up checks of the weight and checkpoint folders, for this run."""
        from apps.common.space import check_checkpoint_space, check_weight_sync_space

        check_weight_sync_space(self.weight_sync, self.trainer, model_dir)
        check_checkpoint_space(self.trainer, self.checkpoint_dir, model_dir)

    def _check_rollout_workers(self) -> None:
        workers = self.rollout.workers
        if workers is None:
            return
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(
                f"rollout.workers must be a number of worker processes >= 1 (or null: the controller makes the "
                f"groups), got {workers!r}"
            )
        if workers > self.rollout_concurrency:
            raise ValueError(
                f"rollout.workers={workers} is more than the prompts in flight (rollout.concurrency, or "
                f"prompts_per_step: {self.rollout_concurrency}); a worker would have no group to make"
            )

    @property
    def rollout_concurrency(self) -> int:
        return self.rollout.concurrency or self.prompts_per_step

    @property
    def max_buffered_groups(self) -> int:
        return self.rollout.max_buffered_groups or self.prompts_per_step * max(1, self.max_policy_age)
