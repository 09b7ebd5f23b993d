"""argparse types of `hal bench`'s options."""

from __future__ import annotations

import argparse
from typing import Callable


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def comma_list(valid: tuple[str, ...], what: str) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated, non-empty subset of `valid` (`what` names one)."""

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        unknown = [v for v in values if v not in valid]
        if unknown or not values:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown}; valid: {','.join(valid)}")
        return values

    return parse