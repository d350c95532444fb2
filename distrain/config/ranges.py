"""The values a numeric config field accepts (`Range`), the ranges most fields use, and `doc`,
which makes a schema field (schema.py, debug.py) with its help text and range."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric field accepts: an interval (either end open or closed, or missing),
    plus `also`, values outside it with a meaning of their own (-1 = "what is left over")."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[int, ...] = ()
    why: str = ""

    def __contains__(self, value: float) -> bool:
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            text = (
                f"in {'(' if self.low_open else '['}{_num(self.low)}, "
                f"{_num(self.high)}{')' if self.high_open else ']'}"
            )
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        else:
            text = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        also = "".join(f"{_num(a)} or " for a in self.also)
        return f"{also}{text}" + (f" ({self.why})" if self.why else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# The ranges most fields use.
POSITIVE = Range(low=0, low_open=True)
AT_LEAST_0 = Range(low=0)
AT_LEAST_1 = Range(low=1)
FRACTION = Range(low=0, high=1)
AUTO_OR_AT_LEAST_1 = Range(low=1, also=(-1,))
ANY_RANK = Range(low=0, also=(-1,))
BETA = Range(low=0, high=1, high_open=True)


def doc(default: Any, help: str, valid: Range | None = None) -> Any:
    """A dataclass field with a default, a help text shown by `--help` and, for a number, the
    range of values it accepts (checked by `validate`)."""
    metadata: dict[str, Any] = {"help": help}
    if valid is not None:
        metadata["range"] = valid
    return field(default=default, metadata=metadata)
