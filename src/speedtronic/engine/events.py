"""Dispatch of training events (train_start, step_end, step, eval, checkpoint, train_end) to hooks.

`step_end` comes after every step with the step number alone (so a progress bar can move without
reading a device value); `step` comes on logging steps with the loss, lr, throughput and memory.

A hook is any object with some of the methods `on_<event>(payload)`, or a generic
`on_event(event, payload)` that receives every event it has no `on_<event>` method for, and
optionally `close()`. A hook that raises is reported once and switched off, so a broken logger never
stops training. Which method serves an event is looked up once per hook and event, not per step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from speedtronic.registry import resolve_registries

if TYPE_CHECKING:
    from speedtronic.config import Config
    from speedtronic.registry import Registries

logger = logging.getLogger(__name__)

EVENTS = ("train_start", "step_end", "step", "eval", "checkpoint", "train_end")


class EventBus:
    def __init__(self, hooks: dict[str, Any] | None = None) -> None:
        self.hooks: dict[str, Any] = dict(hooks or {})
        self._methods: dict[tuple[str, str], Any] = {}  # (hook name, event) -> callable(payload) | None

    def add(self, name: str, hook: Any) -> None:
        self.hooks[name] = hook
        self._methods = {k: v for k, v in self._methods.items() if k[0] != name}

    def _method(self, name: str, hook: Any, event: str) -> Any:
        key = (name, event)
        if key not in self._methods:
            method = getattr(hook, f"on_{event}", None)
            generic = getattr(hook, "on_event", None)
            if method is None and callable(generic):
                method = lambda payload, _g=generic, _e=event: _g(_e, payload)  # noqa: E731
            self._methods[key] = method
        return self._methods[key]

    def emit(self, event: str, payload: dict[str, Any]) -> None:
        for name, hook in list(self.hooks.items()):
            method = self._method(name, hook, event)
            if method is None:
                continue
            try:
                method(payload)
            except Exception as error:
                logger.warning(
                    "hook %r failed on %s (%s: %s); it is disabled for this run",
                    name,
                    event,
                    type(error).__name__,
                    error,
                )
                self._close(name, hook)
                del self.hooks[name]

    def close(self) -> None:
        for name, hook in list(self.hooks.items()):
            self._close(name, hook)
        self.hooks.clear()

    @staticmethod
    def _close(name: str, hook: Any) -> None:
        close = getattr(hook, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception as error:
            logger.warning("hook %r failed to close (%s)", name, error)


def build_hooks(names: list[str], config: Config, registries: Registries | None = None) -> dict[str, Any]:
    """Instantiate the hooks named in `logging.hooks` from `registries` (None: the built-ins)."""
    registry = resolve_registries(registries).hooks
    return {name: registry.get(name)(config) for name in dict.fromkeys(names)}


def build_events(
    config: Config, registries: Registries | None, is_main: bool, hooks: dict[str, Any] | None = None
) -> EventBus:
    """A run's event bus: the hooks `logging.hooks` names and the caller's own, on rank 0 alone (hooks,
    progress and files belong to rank 0; the other ranks train silently)."""
    events = EventBus(build_hooks(config.logging.hooks, config, registries) if is_main else {})
    for name, hook in (hooks or {}).items() if is_main else ():
        events.add(name, hook)
    return events
