"""Job priorities: the named levels and the numbers the scheduler orders by.

A job's ``priority`` is ``low``, ``normal`` (the default), ``high`` or an integer 0-100;
higher runs first, and a waiting job may preempt one at least
``TUNEFLEET_PREEMPTION_MIN_PRIORITY_GAP`` lower. The API stores the number, so the
table below is the only place a name becomes one.
"""

from __future__ import annotations

PRIORITIES: dict[str, int] = {"low": 25, "normal": 50, "high": 75}
DEFAULT_PRIORITY = PRIORITIES["normal"]


def priority_value(name: str | int) -> int:
    """Map a priority name (or an int, kept as given) to the number the scheduler orders by."""
    if isinstance(name, int):
        return name
    try:
        return PRIORITIES[name]
    except KeyError:
        raise ValueError(f"unknown priority {name!r}; use one of {', '.join(PRIORITIES)}") from None
