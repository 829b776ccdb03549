"""Field checks for the configuration dataclasses: each names the field and the accepted range.

A wrong type is a TypeError, a value out of range a ValueError; both start with the field's name
(the server turns that name into the OpenAI error's `param`).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable


def check_int(name: str, value, lo: int | None = None, hi: int | None = None,
              optional: bool = False) -> int | None:
    """An integer (not a bool, not a float) in [lo, hi]; None too when `optional`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer{_range(lo, hi)}{' or None' * optional}, "
                        f"got {value!r} ({type(value).__name__})")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an integer{_range(lo, hi)}, got {value}")
    return value


def check_float(name: str, value, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, optional: bool = False) -> float | None:
    """A finite real number in [lo, hi] (or (lo, hi] with `lo_open`); ints are taken."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number{_range(lo, hi, lo_open)}, "
                        f"got {value!r} ({type(value).__name__})")
    value = float(value)
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    if not math.isfinite(value) or too_low or (hi is not None and value > hi):
        raise ValueError(f"{name} must be a finite number{_range(lo, hi, lo_open)}, got {value}")
    return value


def check_bool(name: str, value, optional: bool = False) -> bool | None:
    """True or False: a string such as 'no' is refused, not taken as true."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False{' or None' * optional}, "
                        f"got {value!r} ({type(value).__name__})")
    return value


def check_str(name: str, value, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty string{' or None' * optional}, "
                        f"got {value!r} ({type(value).__name__})")
    return value


def check_choice(name: str, value, choices: Iterable) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _range(lo, hi, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def check_triton_device(what: str, device_type: str, instead: str = "") -> None:
    """ValueError naming `what` (the setting that asked for Triton kernels) unless this device can
    run them: CUDA, or the interpreter on the CPU. `instead`: what else the user can set."""
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{what} runs Triton kernels: it needs a CUDA device (got {device_type!r}), or "
            f"TRITON_INTERPRET=1 on the CPU (slow; for tests){instead}")
