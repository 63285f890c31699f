"""Serving a forge policy service to clients outside forge: an OpenAI-compatible HTTP front door."""

from forge.serving.openai_app import FrontSettings, OpenAIError, make_app

__all__ = ["FrontSettings", "OpenAIError", "make_app"]
