"""One rule for reading a number out of a CSV cell, a JSON value or a tool's output."""
from __future__ import annotations

import math
from typing import Optional


def finite(x) -> Optional[float]:
    """``float(x)`` when that is a finite number; None for None, NaN, inf and anything not a number."""
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
