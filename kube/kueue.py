"""What Kueue reads on a training Job: its LocalQueue and its WorkloadPriorityClass.

With Kueue mode on (``TUNEFLEET_KUEUE_QUEUE``) the executor labels every Job with the
LocalQueue and creates it suspended; Kueue admits it against its ClusterQueue's quota.
The operator maps tunefleet's job priorities (``low``/``normal``/``high`` or 0-100) onto
the cluster's WorkloadPriorityClasses with ``TUNEFLEET_KUEUE_PRIORITY_CLASSES``, e.g.
``low=batch-low,normal=batch,75=batch-high``: a job gets the class of the highest
priority listed that is not above its own (none below: no class, Kueue's default).
"""

from __future__ import annotations

import re

from scheduling.priorities import priority_value

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")

PriorityClasses = tuple[tuple[int, str], ...]


def parse_priority_classes(text: str | None) -> PriorityClasses:
    """``"low=a,75=b"`` -> ``((25, "a"), (75, "b"))``, sorted by priority.

    Raises:
        ValueError: an entry that is not ``priority=class``, an unknown priority name, a
            number outside 0-100, a class that is not a Kubernetes object name, or a
            priority given twice; the message names the entry.
    """
    classes: dict[int, str] = {}
    for entry in (e.strip() for e in (text or "").split(",")):
        if not entry:
            continue
        key, sep, name = (part.strip() for part in entry.partition("="))
        if not sep or not key or not name:
            raise ValueError(f"{entry!r}: expected priority=WorkloadPriorityClass, e.g. high=batch-high")
        try:
            priority = priority_value(int(key) if key.isdigit() else key)
        except ValueError as exc:
            raise ValueError(f"{entry!r}: {exc}") from None
        if not 0 <= priority <= 100:
            raise ValueError(f"{entry!r}: a priority is 0-100")
        if not _NAME.match(name):
            raise ValueError(f"{entry!r}: {name!r} is not a Kubernetes object name")
        if priority in classes:
            raise ValueError(f"{entry!r}: priority {priority} is mapped twice")
        classes[priority] = name
    return tuple(sorted(classes.items()))


def priority_class_for(priority: int, classes: PriorityClasses) -> str | None:
    """The WorkloadPriorityClass of a job of ``priority`` (None: no class applies)."""
    chosen = None
    for threshold, name in classes:
        if threshold <= priority:
            chosen = name
    return chosen
