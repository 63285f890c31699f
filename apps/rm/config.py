"""The reward-model app's config: the preference apps' sections (``apps.common.preferences``), a
trainer of the optimizer's settings alone (the loss is Bradley-Terry's: no knobs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.common.config import LoggingSection
from apps.common.preferences import PreferenceSections


@dataclass(kw_only=True)
class RMConfig(PreferenceSections):
    """A reward model trained on preference pairs: ``model.path`` under a one-output head."""

    logging: LoggingSection = field(default_factory=lambda: LoggingSection(output_dir="outputs/rm"))
