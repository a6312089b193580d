"""Requests, the generation loop and the ``LLM`` Python API."""

from __future__ import annotations

from deimos.engine.llm import LLM, Completion
from deimos.engine.request import Request, RequestError

__all__ = ["LLM", "Completion", "Request", "RequestError"]
