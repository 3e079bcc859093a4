"""Who generates next on one base model: turns taken round robin over tenants, each turn
at most a budget of tokens.

Generations on one base share its weights and its active adapter, so one runs at a time.
Instead of holding the model from the first token to the last (one tenant's
``n: 16`` request would keep everyone else waiting for all of its tokens), a generation
holds it for one *turn*: its prompt's prefill and generated tokens count against
``budget_tokens``, and once they are spent it hands the model on if anyone waits, and
queues again. Waiting generations are grouped per tenant; turns go to the tenants in
rotation (the tenant served last goes to the back), and within a tenant in arrival
order. So a tenant's short request waits for at most one turn of each other tenant with
work on that model, however many requests those tenants have queued.

Every wait here is on one condition variable shared with the engine (model loads), so
a cancelled generation is woken at once (:meth:`FairTurns.wake`), never polled for.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass


class TurnCancelled(Exception):
    """The generation was cancelled while it waited for a turn."""


@dataclass(eq=False)
class Seat:
    """One generation's place on a model: its tenant and the tokens of its current turn."""

    tenant: str
    spent: int = 0


class FairTurns:
    """Turns on one model (see the module doc). Thread-safe; waits on ``condition``."""

    def __init__(self, budget_tokens: int, condition: threading.Condition, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if budget_tokens < 1:
            raise ValueError("budget_tokens must be at least 1")
        self.budget_tokens = budget_tokens
        self._cond = condition
        self._clock = clock
        self._waiting: OrderedDict[str, deque[Seat]] = OrderedDict()  # tenant -> seats; order = rotation
        self._holder: Seat | None = None
        self._last_progress = clock()

    def acquire(self, seat: Seat, cancelled: Callable[[], bool]) -> None:
        """Block until ``seat`` holds the model; :class:`TurnCancelled` once ``cancelled()``."""
        with self._cond:
            self._enqueue(seat)
            self._grant_if_free()
            while self._holder is not seat:
                if cancelled():
                    self._remove(seat)
                    raise TurnCancelled
                self._cond.wait()
            seat.spent = 0

    def spend(self, seat: Seat, tokens: int) -> bool:
        """Count ``tokens`` against the holder's turn; True when its budget is spent while
        another generation waits (the holder should then :meth:`pass_on`)."""
        with self._cond:
            seat.spent += tokens
            self._last_progress = self._clock()
            return seat.spent >= self.budget_tokens and bool(self._waiting)

    def pass_on(self, seat: Seat, cancelled: Callable[[], bool]) -> None:
        """End the holder's turn, queue it again behind the others, and block until its next
        turn (:class:`TurnCancelled` if cancelled meanwhile: it then holds nothing)."""
        self.release(seat)
        self.acquire(seat, cancelled)

    def release(self, seat: Seat) -> None:
        """``seat`` is done with the model (or gives its turn up): the next one gets it."""
        with self._cond:
            if self._holder is seat:
                self._holder = None
                if seat.tenant in self._waiting:  # served just now: behind every other tenant
                    self._waiting.move_to_end(seat.tenant)
                self._grant_if_free()
            else:
                self._remove(seat)

    def wake(self) -> None:
        """Wake every waiter to look at its state again (a generation was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    def busy(self) -> bool:
        with self._cond:
            return self._holder is not None or bool(self._waiting)

    def stalled_s(self) -> float:
        """Seconds since the holder last produced a token (or got its turn); 0 when idle."""
        with self._cond:
            if self._holder is None:
                return 0.0
            return max(0.0, self._clock() - self._last_progress)

    def _enqueue(self, seat: Seat) -> None:
        self._waiting.setdefault(seat.tenant, deque()).append(seat)

    def _remove(self, seat: Seat) -> None:
        queue = self._waiting.get(seat.tenant)
        if queue is not None and seat in queue:
            queue.remove(seat)
            if not queue:
                del self._waiting[seat.tenant]

    def _grant_if_free(self) -> None:
        if self._holder is not None or not self._waiting:
            return
        tenant, queue = next(iter(self._waiting.items()))
        self._holder = queue.popleft()
        del self._waiting[tenant]
        if queue:  # the tenant's other generations wait behind every other tenant
            self._waiting[tenant] = queue
        self._last_progress = self._clock()
        self._cond.notify_all()
