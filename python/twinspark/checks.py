"""Type checks for values that come from users (JSON, TOML, flags, keyword arguments), closing what
``isinstance(x, int)`` lets through by accident: a bool is an int, and NaN and inf are floats."""

from __future__ import annotations

import math
from numbers import Integral, Real


def is_int(x) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def is_number(x) -> bool:
    """A finite real number that is not a bool."""
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)
