"""Command-line values checked where they are parsed: a bad one is a usage error naming the
option (exit 2), never an internal error once the work has started."""

from __future__ import annotations

import argparse
from typing import Callable


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse `type`: a whole number from `low` to `high`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not between {low} and {high}")
        return value

    return parse
