"""The engine's work queue: commands that the loop thread runs between steps (tools/server/server-queue.cpp)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

__all__ = ["Command"]


@dataclass
class Command:
    """Work for the loop thread that must not run beside a step (slot files)."""

    fn: Callable[[], Any]
    future: Future
