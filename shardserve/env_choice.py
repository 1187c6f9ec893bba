"""Settings chosen by environment variable from a fixed set of values."""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The value of the environment variable `name` (`default` where unset), which must be one of `choices`: a
    ValueError naming the variable, its value and the accepted values otherwise."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value
