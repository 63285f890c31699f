"""load_config: precedence, interpolation, and errors that name the full key and what was expected."""

from dataclasses import dataclass, field

import pytest
import yaml
from omegaconf import MISSING

from forge.config import ConfigError, config_to_dict, config_to_yaml, load_config


@dataclass
class _Trainer:
    lr: float = 1e-3
    steps: int = 10
    name: str = "default"
    dims: list[int] = field(default_factory=lambda: [1, 2])


@dataclass
class _App:
    trainer: _Trainer = field(default_factory=_Trainer)
    seed: int = 0
    run_name: str = "run-${seed}"
    extras: dict = field(default_factory=dict)


@dataclass
class _Required:
    model_path: str = MISSING
    trainer: _Trainer = field(default_factory=_Trainer)


def _yaml(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# Merging


def test_defaults_alone_give_a_schema_instance():
    """No file, no overrides: the dataclass defaults, as an instance of the schema."""
    cfg = load_config(_App, None, [])
    assert isinstance(cfg, _App) and isinstance(cfg.trainer, _Trainer)
    assert cfg.trainer.lr == 1e-3 and cfg.seed == 0


def test_precedence_is_cli_over_file_over_defaults(tmp_path):
    """steps: default 10, file 20, CLI 30 -> 30; lr only in the file -> file; name only default."""
    path = _yaml(tmp_path, "trainer:\n  steps: 20\n  lr: 0.5\n")
    cfg = load_config(_App, str(path), ["trainer.steps=30"])
    assert cfg.trainer.steps == 30
    assert cfg.trainer.lr == 0.5
    assert cfg.trainer.name == "default"


def test_later_overrides_win_over_earlier_ones():
    """Overrides apply left to right."""
    assert load_config(_App, None, ["seed=1", "seed=2"]).seed == 2


def test_override_values_are_parsed_as_yaml_and_converted_to_field_types():
    """'1e-4' becomes a float, '[3,4]' a list of ints, free-form dict fields accept new keys."""
    cfg = load_config(_App, None, ["trainer.lr=1e-4", "trainer.dims=[3,4]", "extras.note=hi"])
    assert cfg.trainer.lr == pytest.approx(1e-4) and isinstance(cfg.trainer.lr, float)
    assert cfg.trainer.dims == [3, 4]
    assert cfg.extras == {"note": "hi"}


def test_interpolation_is_resolved_after_all_sources_merge(tmp_path):
    """run_name '${seed}' follows the final seed; a file may interpolate too."""
    path = _yaml(tmp_path, "trainer:\n  name: ${run_name}-trainer\n")
    cfg = load_config(_App, path, ["seed=7"])
    assert cfg.run_name == "run-7"
    assert cfg.trainer.name == "run-7-trainer"


# ---------------------------------------------------------------------------------------------
# Errors


def test_unknown_key_in_file_names_full_path_and_suggests(tmp_path):
    """trainer.lrr in a file: the dotted path, the known keys and a did-you-mean."""
    path = _yaml(tmp_path, "trainer:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(_App, path, [])
    message = str(info.value)
    assert info.value.key == "trainer.lrr"
    assert "trainer.lrr" in message and "'trainer.lr'" in message and str(path) in message


def test_unknown_key_in_override_names_the_override():
    """An unknown top-level key from the CLI lists the known top-level keys."""
    expected = r"nope: unknown key \(from override 'nope=1'\); known keys: trainer, seed"
    with pytest.raises(ConfigError, match=expected):
        load_config(_App, None, ["nope=1"])


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("trainer.lr=abc", "trainer.lr", "expected float"),
        ("trainer.steps=1.5", "trainer.steps", "expected int"),
        ("trainer.dims=[1,x]", "trainer.dims[1]", "expected list[int]"),
        ("seed=[1]", "seed", "expected int"),
    ],
)
def test_wrong_type_names_the_key_and_the_expected_type(override, key, expected):
    """A value that cannot become the field's type is a ConfigError with path and type."""
    with pytest.raises(ConfigError) as info:
        load_config(_App, None, [override])
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}:")
    assert expected in str(info.value)


def test_wrong_type_in_file_names_the_file(tmp_path):
    """The source of a bad value is part of the message."""
    path = _yaml(tmp_path, "trainer:\n  steps: many\n")
    with pytest.raises(ConfigError, match=rf"trainer.steps: .*expected int; from file {path}"):
        load_config(_App, path, [])


def test_scalar_where_a_section_belongs_names_the_section():
    """trainer=5 says trainer is a section and lists its fields."""
    with pytest.raises(ConfigError, match=r"trainer: expected a section of _Trainer fields \(lr, steps"):
        load_config(_App, None, ["trainer=5"])


def test_missing_required_value_names_the_key():
    """A MISSING field left unset is reported with its path and type."""
    with pytest.raises(ConfigError, match=r"model_path: missing required value \(str\)") as info:
        load_config(_Required, None, [])
    assert info.value.key == "model_path"
    assert load_config(_Required, None, ["model_path=/m"]).model_path == "/m"


def test_broken_interpolation_names_the_key():
    """An interpolation to a non-existent key is a ConfigError naming where it was used."""
    with pytest.raises(ConfigError, match=r"run_name: cannot resolve interpolation: .*'nope'"):
        load_config(_App, None, ["run_name=${nope}"])


def test_interpolated_value_of_wrong_type_is_an_error():
    """trainer.steps=${run_name} resolves to a string: expected int."""
    with pytest.raises(ConfigError, match=r"trainer.steps: .*expected int"):
        load_config(_App, None, ["trainer.steps=${run_name}"])


@pytest.mark.parametrize("override", ["trainer.lr", "=3"])
def test_malformed_override_is_an_error(override):
    """An override without 'key=' is refused and quoted."""
    with pytest.raises(ConfigError, match="expected 'dotted.key=value'"):
        load_config(_App, None, [override])


def test_missing_or_malformed_file_is_an_error(tmp_path):
    """A missing path, invalid YAML and a top-level list are ConfigErrors naming the file."""
    with pytest.raises(ConfigError, match="not found"):
        load_config(_App, tmp_path / "absent.yaml", [])
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_App, _yaml(tmp_path, "trainer: [1,\n", "bad.yaml"), [])
    with pytest.raises(ConfigError, match="mapping"):
        load_config(_App, _yaml(tmp_path, "- 1\n- 2\n", "list.yaml"), [])


def test_empty_file_keeps_the_defaults(tmp_path):
    """An empty YAML file is a valid, empty layer."""
    assert load_config(_App, _yaml(tmp_path, ""), []) == load_config(_App, None, [])


def test_schema_must_be_a_dataclass():
    """Passing an instance or a plain class is a TypeError."""
    with pytest.raises(TypeError, match="dataclass type"):
        load_config(_App(), None, [])


# ---------------------------------------------------------------------------------------------
# Logging helpers


def test_config_to_yaml_round_trips_the_resolved_config():
    """The YAML text loads back to the resolved values, interpolations already substituted."""
    cfg = load_config(_App, None, ["seed=3"])
    loaded = yaml.safe_load(config_to_yaml(cfg))
    assert loaded == config_to_dict(cfg)
    assert loaded["run_name"] == "run-3"
    assert load_config(_App, None, [f"{k}={v}" for k, v in loaded.items() if k in ("seed", "run_name")]) == cfg


# ---------------------------------------------------------------------------------------------
# Optional sections and "???" in a file


@dataclass
class _WithOptional:
    extra: _Trainer | None = None
    name: str = "default"


def test_optional_section_can_be_set_from_yaml_and_override(tmp_path):
    cfg = load_config(_WithOptional, _yaml(tmp_path, "extra:\n  lr: 0.5\n"), ["extra.steps=3"])
    assert cfg.extra == _Trainer(lr=0.5, steps=3)
    assert load_config(_WithOptional).extra is None


def test_unknown_key_in_optional_section_names_its_siblings(tmp_path):
    with pytest.raises(
        ConfigError, match=r"extra\.lrr: unknown key .*known keys under 'extra': lr, steps.*did you mean 'extra.lr'"
    ):
        load_config(_WithOptional, _yaml(tmp_path, "extra:\n  lrr: 0.5\n"))


def test_question_marks_in_yaml_make_a_defaulted_field_required(tmp_path):
    path = _yaml(tmp_path, "name: ???\nextra:\n  steps: ???\n")
    with pytest.raises(ConfigError, match=r"name: missing required value \(str\)"):
        load_config(_WithOptional, path, ["extra.steps=4"])
    with pytest.raises(ConfigError, match=r"extra.steps: missing required value \(int\)"):
        load_config(_WithOptional, path, ["name=x"])
    assert load_config(_WithOptional, path, ["name=x", "extra.steps=4"]).extra.steps == 4


# ---------------------------------------------------------------------------------------------
# A dict- or list-valued field given in a source replaces its default; it is never merged into it


def _container_fields(schema, prefix=""):
    """Every dict- or list-valued field of the app's config, as (dotted key, its type hint)."""
    import dataclasses
    import typing

    from forge.config import _unwrap_optional

    out = []
    for f in dataclasses.fields(schema):
        kind = _unwrap_optional(typing.get_type_hints(schema)[f.name])
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            out += [(f"{f.name}.{k}", v) for k, v in _container_fields(kind)]
        elif (typing.get_origin(kind) or kind) in (dict, list):
            out.append((f.name, kind))
    return out


def _grpo_container_fields():
    from apps.grpo.config import GRPOConfig

    return _container_fields(GRPOConfig)


def test_every_app_section_with_a_dict_or_list_field_is_covered():
    """The replace-not-merge tests below run over these keys; the bug was in reward.fns."""
    keys = {key for key, _ in _grpo_container_fields()}
    assert {"reward.fns", "logging.sinks", "data.options", "policy.env", "trainer.env", "reference.env"} <= keys


def _with_context(key, tree):
    """``tree`` plus what the field's own section needs to be valid (addresses need an attach job)."""
    if key == "hosts.addresses":
        tree["hosts"]["job"] = "attach"
    return tree


def _is_list(kind):
    import typing

    return (typing.get_origin(kind) or kind) is list


def _replacement_for(key, kind, other=False):
    """A value for ``key`` that shares no entry with its default, in the field's own types;
    ``other`` gives a second such value, different from the first."""
    import typing

    known = {
        "logging.sinks": (["jsonl"], ["jsonl", "console"]),
        "hosts.addresses": (["tcp://127.0.0.1:29501"], ["tcp://127.0.0.1:29502"]),
        "reward.fns": ({"gsm8k": 1.0}, {"other_key": 7.0}),
    }
    if key in known:
        return known[key][other]
    args = typing.get_args(kind)
    if _is_list(kind):
        return ([10] if other else [8, 9]) if args and args[0] is int else (["other"] if other else ["replacement"])
    value = {"int": 3, "float": 0.5}.get(getattr(args[1], "__name__", ""), "1") if len(args) == 2 else 2
    return {("other_key" if other else "only_this"): value}


@pytest.mark.parametrize("key,kind", _grpo_container_fields(), ids=[k for k, _ in _grpo_container_fields()])
def test_a_dict_or_list_field_from_yaml_replaces_its_default(tmp_path, key, kind):
    """Each section: the YAML value is what runs, with none of the default's entries added."""
    from apps.grpo.config import GRPOConfig

    value = _replacement_for(key, kind)
    section, leaf = key.rsplit(".", 1) if "." in key else ("", key)
    nested = {leaf: value}
    for part in reversed(section.split(".") if section else []):
        nested = {part: nested}
    path = _yaml(tmp_path, yaml.safe_dump(_with_context(key, nested)))
    cfg = load_config(GRPOConfig, path, ["model.path=/m"])
    got = cfg
    for part in key.split("."):
        got = getattr(got, part)
    assert got == value


def test_shipped_qwen3_config_runs_only_the_gsm8k_reward():
    """configs/qwen3_1_7b.yaml says ``fns: {gsm8k: 1.0}``; the toy default must not be added."""
    from apps.grpo.config import GRPOConfig

    cfg = load_config(GRPOConfig, "configs/qwen3_1_7b.yaml", ["model.path=/m", "data.path=/d.jsonl"])
    assert cfg.reward.fns == {"gsm8k": 1.0}


def test_the_medium_config_is_the_size_benchmarks_vs_trl_promises():
    """configs/grpo_medium.yaml (vs_trl.py's medium workload): >= 10 M parameters (512 x 4 with
    intermediate 2 x 512), >= 32 new tokens, group 8 and 16-32 prompts, packing on both sides."""
    from apps.grpo.config import GRPOConfig

    cfg = load_config(GRPOConfig, "configs/grpo_medium.yaml", [])
    tiny = cfg.model.tiny
    per_layer = 4 * tiny.hidden_size**2 + 3 * tiny.hidden_size * 2 * tiny.hidden_size
    assert tiny.num_layers * per_layer >= 10_000_000, (tiny.hidden_size, tiny.num_layers)
    assert cfg.policy.max_tokens >= 32 and cfg.group_size == 8 and 16 <= cfg.prompts_per_step <= 32
    assert cfg.policy.max_model_len >= cfg.policy.max_tokens + 8  # prompts of "ddd=" and room
    assert cfg.trainer.pack_sequences and cfg.reference.pack_sequences


def test_an_override_of_a_dict_field_replaces_it_and_a_dotted_one_sets_one_entry(tmp_path):
    from apps.grpo.config import GRPOConfig

    path = _yaml(tmp_path, "model: {path: /m}\nreward: {fns: {gsm8k: 1.0}}\n")
    assert load_config(GRPOConfig, path, ["reward.fns={toy: 0.5}"]).reward.fns == {"toy": 0.5}
    assert load_config(GRPOConfig, path, ["reward.fns.toy=0.5"]).reward.fns == {"gsm8k": 1.0, "toy": 0.5}
    assert load_config(GRPOConfig, path, ["logging.sinks=[jsonl]"]).logging.sinks == ["jsonl"]


def test_a_replaced_dict_is_still_checked_against_its_value_type(tmp_path):
    from apps.grpo.config import GRPOConfig

    with pytest.raises(ConfigError, match="reward.fns.toy"):
        load_config(GRPOConfig, _yaml(tmp_path, "model: {path: /m}\nreward: {fns: {toy: high}}\n"))


def test_config_changes_lists_only_what_differs_from_the_defaults(tmp_path):
    from apps.grpo.config import GRPOConfig
    from forge.config import config_changes

    path = _yaml(tmp_path, "model: {path: /m}\nreward: {fns: {gsm8k: 1.0}}\ntrainer: {lr: 0.5}\n")
    changes = config_changes(load_config(GRPOConfig, path, ["steps=7"]))
    assert changes == {"steps": 7, "model": {"path": "/m"}, "reward": {"fns": {"gsm8k": 1.0}}, "trainer": {"lr": 0.5}}


def test_the_app_writes_the_resolved_config_and_prints_the_changes(tmp_path):
    import io

    from apps.common.cli import record_config
    from apps.grpo.config import GRPOConfig

    out = tmp_path / "run"
    cfg = load_config(GRPOConfig, None, ["model.path=/m", f"logging.output_dir={out}", "reward.fns={gsm8k: 1.0}"])
    terminal = io.StringIO()
    path = record_config(cfg, terminal, "grpo")
    assert path == out / "config.yaml"
    written = yaml.safe_load(path.read_text())
    assert written["reward"]["fns"] == {"gsm8k": 1.0} and written["steps"] == cfg.steps
    assert "gsm8k: 1.0" in terminal.getvalue() and "lr:" not in terminal.getvalue()


@pytest.mark.parametrize("key,kind", _grpo_container_fields(), ids=[k for k, _ in _grpo_container_fields()])
def test_a_dict_or_list_field_from_an_override_replaces_the_files_value(tmp_path, key, kind):
    """Each section: ``key=<value>`` on the command line replaces what the YAML file set."""
    from apps.grpo.config import GRPOConfig

    in_file = _replacement_for(key, kind)
    *sections, leaf = key.split(".")  # a nested section (trainer.lora) is nested in the file too
    tree: dict = {leaf: in_file}
    for name in reversed(sections):
        tree = {name: tree}
    path = _yaml(tmp_path, yaml.safe_dump(_with_context(key, {"model": {"path": "/m"}, **tree})))
    on_line = _replacement_for(key, kind, other=True)
    cfg = load_config(GRPOConfig, path, [f"{key}={yaml.safe_dump(on_line, default_flow_style=True).strip()}"])
    got = cfg
    for name in key.split("."):
        got = getattr(got, name)
    assert got == on_line


def test_rollout_dynamic_sampling_keys_default_off_and_parse_from_overrides_and_yaml(tmp_path):
    """Off by default with an unset bound; true/3 from overrides; null from YAML keeps the default bound."""
    from apps.grpo.config import GRPOConfig

    defaults = load_config(GRPOConfig, None, ["model.path=/m"]).rollout
    assert defaults.dynamic_sampling is False and defaults.max_dropped_per_step is None
    cfg = load_config(
        GRPOConfig, None, ["model.path=/m", "rollout.dynamic_sampling=true", "rollout.max_dropped_per_step=3"]
    )
    assert cfg.rollout.dynamic_sampling is True and cfg.rollout.max_dropped_per_step == 3
    path = _yaml(tmp_path, "model: {path: /m}\nrollout: {dynamic_sampling: true, max_dropped_per_step: null}\n")
    assert load_config(GRPOConfig, path).rollout.max_dropped_per_step is None


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.max_dropped_per_step=-1", "rollout.max_dropped_per_step must be >= 0.*got -1"),
        ("rollout.max_dropped_per_step=many", "rollout.max_dropped_per_step"),
        ("rollout.dynamic_sampling=maybe", "rollout.dynamic_sampling"),
    ],
)
def test_bad_rollout_dynamic_sampling_values_are_refused_naming_the_key(override, message):
    from apps.grpo.config import GRPOConfig

    with pytest.raises(ValueError, match=message):
        load_config(GRPOConfig, None, ["model.path=/m", override])


# ---------------------------------------------------------------------------------------------
# trainer.loss_type


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_each_trainer_loss_type_loads_and_reaches_the_trainers_config(loss_type):
    """``trainer.loss_type=...`` loads; the trainer gets it and, for dr_grpo's constant length,
    the policy's generation limit."""
    from apps.grpo.config import GRPOConfig
    from apps.grpo.roles import trainer_config

    cfg = load_config(GRPOConfig, None, ["model.path=/m", f"trainer.loss_type={loss_type}", "policy.max_tokens=24"])
    assert cfg.trainer.loss_type == loss_type
    trainer = trainer_config(cfg, "/m")
    assert (trainer.loss_type, trainer.max_response_tokens) == (loss_type, 24)


def test_default_loss_type_is_grpo_and_multi_turn_length_is_per_turn_times_turns():
    """The default keeps today's loss; a multi-turn episode trains up to max_turns x max_tokens
    of the policy's tokens (the environment's are not trained)."""
    from apps.grpo.config import GRPOConfig

    assert load_config(GRPOConfig, None, ["model.path=/m"]).trainer.loss_type == "grpo"
    multi = ["model.path=/m", "policy.max_tokens=10", "env.cls=forge.envs.toy:ReverseWithFeedback", "env.max_turns=3"]
    assert load_config(GRPOConfig, None, multi).max_response_tokens == 30


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.loss_type=bogus"], r"trainer\.loss_type must be one of grpo, dapo, dr_grpo, got 'bogus'"),
        (["trainer.loss_type=dr_grpo", "policy.max_tokens=0"], r"dr_grpo divides by policy\.max_tokens.*got 0"),
    ],
)
def test_a_bad_trainer_loss_type_is_refused_at_load(overrides, message):
    """An unknown loss_type names the value and the three allowed ones; dr_grpo needs a real length."""
    from apps.grpo.config import GRPOConfig

    with pytest.raises(ValueError, match=message):
        load_config(GRPOConfig, None, ["model.path=/m", *overrides])


def test_trainer_restarts_default_to_one_with_checkpoints_and_a_negative_count_is_refused():
    """A dead trainer is replaced once by default when there are checkpoints to restore, never
    without them; a negative limit is an error naming the key and the value."""
    from apps.grpo.config import GRPOConfig

    with_checkpoints = load_config(GRPOConfig, None, ["model.path=/m", "trainer.checkpoint_every=2"])
    assert with_checkpoints.faults.trainer_restarts(with_checkpoints.trainer.checkpoint_every) == 1
    without = load_config(GRPOConfig, None, ["model.path=/m", "trainer.checkpoint_every=0"])
    assert without.faults.trainer_restarts(without.trainer.checkpoint_every) == 0
    chosen = load_config(GRPOConfig, None, ["model.path=/m", "faults.trainer_max_restarts=3"])
    assert chosen.faults.trainer_restarts(0) == 3
    with pytest.raises(ValueError, match=r"faults.trainer_max_restarts must be an integer >= 0 .* got -1"):
        load_config(GRPOConfig, None, ["model.path=/m", "faults.trainer_max_restarts=-1"])


def test_rollout_workers_default_to_none_and_parse_from_overrides():
    """null: the controller makes the groups; a count from an override."""
    from apps.grpo.config import GRPOConfig

    assert load_config(GRPOConfig, None, ["model.path=/m"]).rollout.workers is None
    assert load_config(GRPOConfig, None, ["model.path=/m", "rollout.workers=2"]).rollout.workers == 2


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.workers=0"], r"rollout.workers must be a number of worker processes >= 1.*got 0"),
        (["rollout.workers=-3"], r"rollout.workers must be .* >= 1.*got -3"),
        (["prompts_per_step=4", "rollout.workers=5"], r"rollout.workers=5 is more than the prompts in flight.*4"),
        (["prompts_per_step=8", "rollout.concurrency=2", "rollout.workers=3"], r"rollout.workers=3 .*: 2\)"),
    ],
)
def test_rollout_workers_below_one_or_above_the_prompts_in_flight_are_refused(overrides, message):
    from apps.grpo.config import GRPOConfig

    with pytest.raises(ValueError, match=message):
        load_config(GRPOConfig, None, ["model.path=/m", *overrides])


def sync_agent(client, prompt):
    return 0.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.agent=forge.envs.agents:reversal_game", "env.cls=forge.envs.toy:ReverseWithFeedback"],
            r"rollout\.agent \('forge\.envs\.agents:reversal_game'\) and env\.cls .* both make the episodes",
        ),
        (
            ["rollout.agent=forge.envs.agents:no_such_agent"],
            r"rollout\.agent 'forge\.envs\.agents:no_such_agent' cannot",
        ),
        (
            ["rollout.agent=reversal_game"],
            r"rollout\.agent must be named 'package\.module:function', got 'reversal_game'",
        ),
        ([f"rollout.agent={__name__}:sync_agent"], r"must be an 'async def fn\(client, prompt\) -> float'"),
        (["rollout.agent=forge.envs.agents:reversal_game", "rollout.agent_timeout_s=0"], r"agent_timeout_s must be"),
    ],
)
def test_a_bad_agent_is_refused_at_load_naming_it(overrides, message):
    from apps.grpo.config import GRPOConfig

    with pytest.raises(ValueError, match=message):
        load_config(GRPOConfig, None, ["model.path=/m", *overrides])


def test_an_agent_run_trains_up_to_the_context_length():
    from apps.grpo.config import GRPOConfig

    cfg = load_config(GRPOConfig, None, ["model.path=/m", "rollout.agent=forge.envs.agents:reversal_game"])
    assert cfg.max_response_tokens == cfg.policy.max_model_len
