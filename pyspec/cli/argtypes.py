"""argparse types with bounds, shared by the commands: a value out of range is a usage error naming the option."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["int_from", "positive_float", "probability"]


def int_from(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low`` (argparse names the option when it is not)."""
    def parse(text: str) -> int:
        v = int(text)
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {v}")
        return v
    parse.__name__ = f"int >= {low}"  # what argparse prints for a value that is not an int
    return parse


def probability(text: str) -> float:
    """An argparse type: a float in [0, 1] (NaN is not)."""
    v = float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text}")
    return v


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    v = float(text)
    if not 0.0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return v
