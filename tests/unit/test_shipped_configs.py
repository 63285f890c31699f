"""Every documented command line loads: each config in configs/ with the overrides the README, the
YAML headers, the scripts and the apps' docstrings give for it, checked by its app's schema."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from apps.dpo.config import DPOConfig
from apps.eval.config import EvalAppConfig
from apps.grpo.config import GRPOConfig
from apps.multi_lora.config import MultiLoraConfig
from apps.rm.config import RMConfig
from apps.serve.config import ServeConfig
from apps.sft.config import SFTConfig
from forge.config import load_config

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = "configs/grpo_tiny.yaml"  # what scripts/grpo.sh runs without --config
# Where command lines are documented, and how to find them there.
SOURCES = [
    "README.md",
    "scripts/grpo.sh",
    "scripts/sft_then_grpo.sh",
    "apps/grpo/main.py",
    "apps/sft/main.py",
    "apps/eval/main.py",
    "apps/multi_lora/main.py",
    "apps/serve/main.py",
    "apps/rm/main.py",
    "apps/dpo/main.py",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml")),
]
SCHEMAS = {
    "grpo": GRPOConfig,
    "sft": SFTConfig,
    "eval": EvalAppConfig,
    "multi_lora": MultiLoraConfig,
    "serve": ServeConfig,
    "rm": RMConfig,
    "dpo": DPOConfig,
}
_LAUNCHERS = re.compile(
    r"(?:(scripts/grpo\.sh)|-m apps\.(grpo|sft|eval|multi_lora|serve|rm|dpo)\.main)\b(.*)|^(--config\s.*)"
)


def _snippets(source: str) -> list[str]:
    """The text that may hold commands: README code spans and blocks; comment or docstring lines."""
    text = (REPO / source).read_text()
    if source.endswith(".md"):
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        spans = re.findall(r"`([^`\n]+(?:\n[^`\n]+)?)`", re.sub(r"```.*?```", "", text, flags=re.S))
        return [line for block in blocks for line in _joined_lines(block)] + [" ".join(s.split()) for s in spans]
    if source.endswith(".yaml") or source.endswith(".sh"):
        header = [line.lstrip("#") for line in text.splitlines() if line.startswith("#")]
        return _joined_lines("\n".join(header))
    return _joined_lines(text.split('"""')[1])  # a module docstring


def _joined_lines(text: str) -> list[str]:
    """Lines with shell continuations (a trailing backslash) joined; a line's own spacing is kept
    (two spaces or more end a command: what follows is its description)."""
    return re.sub(r"\s*\\+\s*\n\s*", " ", text).splitlines()


def documented_commands() -> list[tuple[str, str, str, list[str]]]:
    """(where, app, config, overrides) of every documented run of an app."""
    found = []
    for source in SOURCES:
        for line in _snippets(source):
            match = _LAUNCHERS.search(line.strip())
            if match is None:
                continue
            app = match.group(2) or "grpo"  # scripts/grpo.sh and a bare --config line run GRPO
            rest = match.group(3) if match.group(3) is not None else match.group(4)
            rest = re.split(r"\s{2,}|\s#|\(", rest.strip())[0]  # drop a description or comment
            words = shlex.split(rest)
            config = DEFAULT_CONFIG
            if "--config" in words:
                i = words.index("--config")
                config = words[i + 1]
                del words[i : i + 2]
            overrides = [w for w in words if "=" in w and not w.startswith("-") and "$" not in w]
            found.append((source, app, config, overrides))
    return found


COMMANDS = documented_commands()


def test_the_documented_commands_were_found() -> None:
    """The README's, the scripts' and every config's own command lines are all collected."""
    sources = {source for source, _, _, _ in COMMANDS}
    assert {"README.md", "scripts/grpo.sh", "apps/grpo/main.py", "apps/sft/main.py", "apps/eval/main.py"} <= sources
    configs = {config for _, _, config, _ in COMMANDS}
    shipped = {str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml")}
    assert shipped <= configs, f"configs without a documented command line: {sorted(shipped - configs)}"
    assert any("data.path=" in " ".join(o) for s, _, c, o in COMMANDS if s == "README.md" and "qwen3" in c)


@pytest.mark.parametrize(
    "source, app, config, overrides", COMMANDS, ids=[f"{s}:{c}:{' '.join(o)}" for s, _, c, o in COMMANDS]
)
def test_documented_command_line_loads(source: str, app: str, config: str, overrides: list[str]) -> None:
    """The config loads and validates, with its app's schema, with exactly the documented overrides."""
    cfg = load_config(SCHEMAS[app], str(REPO / config), overrides)
    for override in overrides:
        key, value = override.split("=", 1)
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        assert str(node) == value or str(node) == str(type(node)(value)), f"{source}: {override} was not applied"
    if app == "multi_lora":
        cfg.run_configs()  # every run's GRPO config loads and the runs agree on the shared policy


def test_qwen3_command_without_data_path_fails_naming_it() -> None:
    """The fault the README once had: the Qwen3 config without data.path is refused, by name."""
    with pytest.raises(ValueError, match="data.path"):
        load_config(GRPOConfig, str(REPO / "configs/qwen3_1_7b.yaml"), ["model.path=/path/to/Qwen3-1.7B"])
