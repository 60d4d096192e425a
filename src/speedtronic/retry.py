"""The one retry and back-off policy: every bus backend, the master's round loop and the worker's
uploads wait the same way.

- Exponential back-off with jitter between `initial` and `max_delay` seconds, for transient failures
  only (`TransientBusError`); anything else fails at once.
- A server's own word wins: a failure carrying `retry_after` (an HTTP 429/503's Retry-After) waits that
  long, up to an hour, and does not count as a failed attempt, so rate limits are never fatal —
  unless `budget_s`, a cap on the seconds one call may spend retrying, runs out first (`hub status`
  uses a few seconds: a status check answers in seconds, not minutes).
- `attempts` failed tries (not counting rate-limit waits) and the last failure is raised.
- A process that is stopping (SIGINT/SIGTERM: speedtronic/interrupts.py) does not retry: the wait is
  cut short by the signal and the failure raised at once, marked "not retried: stopping". A node whose
  bus is down exits within seconds of a SIGTERM, not after minutes of back-off.

Torch-free and network-free: the caller passes the function and a `classify` that maps a library's
exception to a BusError (or returns it unchanged when it already is one).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from speedtronic import interrupts
from speedtronic.errors import BusError, TransientBusError

if TYPE_CHECKING:
    from speedtronic.config.distributed import BusConfig

logger = logging.getLogger("speedtronic.retry")
T = TypeVar("T")
MAX_RETRY_AFTER_S = 3600.0


def retry_after_of(error: BaseException) -> float | None:
    """Seconds the server asked to wait (set on a TransientBusError by the backend), else None."""
    value = getattr(error, "retry_after", None)
    return None if value is None else max(0.0, min(float(value), MAX_RETRY_AFTER_S))


def given_up(failure: BusError) -> TransientBusError:
    """`failure`, not retried because the process is stopping (a signal: speedtronic/interrupts.py)."""
    return TransientBusError(f"{failure} (not retried: the process is stopping)")


def _as_bus_error(error: Exception, what: str) -> BusError:
    return error if isinstance(error, BusError) else BusError(f"{what}: {type(error).__name__}: {error}")


@dataclass(frozen=True)
class RetryPolicy:
    initial: float = 1.0
    max_delay: float = 60.0
    attempts: int = 8
    budget_s: float | None = None  # total seconds one call may spend retrying (None: no cap)

    @classmethod
    def from_config(cls, bus: BusConfig | None, **overrides: Any) -> RetryPolicy:
        """The policy of the `distributed.bus` config section (retry_initial, retry_max, retry_attempts)."""
        settings: dict[str, Any] = {}
        if bus is not None:
            settings = {
                "initial": bus.retry_initial,
                "max_delay": bus.retry_max,
                "attempts": bus.retry_attempts,
            }
        settings.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**settings)

    def backoff(self) -> Backoff:
        """A fresh back-off sequence for a loop that retries on its own schedule."""
        return Backoff(self)

    def call(
        self,
        what: str,
        fn: Callable[[], T],
        classify: Callable[[Exception, str], BusError] = _as_bus_error,
        sleep: Callable[[float], None] | None = None,
    ) -> T:
        """Run `fn`, retrying transient failures (as `classify` sees them) with back-off; the waits
        end early, and the failure is raised, when the process is stopping (`sleep`: tests' own)."""
        backoff = self.backoff()
        started = time.monotonic()
        while True:
            try:
                return fn()
            except Exception as error:
                failure = classify(error, what) if not isinstance(error, BusError) else error
                if not isinstance(failure, TransientBusError):
                    if failure is error:
                        raise
                    raise failure from None
                limited = retry_after_of(failure)
                if limited is None and backoff.failures >= self.attempts:
                    raise failure from None
                wait = limited if limited is not None else backoff.next_delay()
                if self.budget_s is not None and time.monotonic() - started + wait > self.budget_s:
                    raise failure from None
                if interrupts.stopping():
                    raise given_up(failure) from None
                logger.warning(
                    "%s; retrying in %.1fs (%s)",
                    failure,
                    wait,
                    "rate limited" if limited is not None else f"{backoff.failures}/{self.attempts}",
                )
                if sleep is not None:
                    sleep(wait)
                elif interrupts.wait(wait):
                    raise given_up(failure) from None


class Backoff:
    """One back-off sequence: `next_delay()` after a failure, `reset()` after a success."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.failures = 0
        self._delay = policy.initial

    def next_delay(self) -> float:
        """The wait after one more failure: the current delay with up to 25% jitter, then doubled."""
        self.failures += 1
        wait = min(self._delay * (1 + 0.25 * random.random()), self.policy.max_delay)
        self._delay = min(self._delay * 2, self.policy.max_delay)
        return wait

    def reset(self) -> None:
        self.failures = 0
        self._delay = self.policy.initial
