"""Argument checks shared by the model, the attention variants and the diagnostics: each raises a
TypeError or ValueError that names the argument and what it accepts."""

from __future__ import annotations

import math


def check_int(name: str, value: int, minimum: int = 1) -> None:
    """Raises TypeError/ValueError naming `name` unless value is an int >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_finite_float(name: str, value: float, *, positive: bool = False) -> None:
    """Raises TypeError/ValueError naming `name` unless value is a finite real (> 0 when `positive`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite float{' > 0' if positive else ''}, got {value}")
