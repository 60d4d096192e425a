"""The head and the global model a fresh node starts from, fetched on a thread while its model compiles.

A worker compiles its model before its first step (engine/trainer.py `_compile_ahead`), and
`Coordinator.prefetch` starts this fetch first: on a CPU both take seconds, on a GPU with a large model
over a WAN both take minutes, and neither needs the other. `Coordinator.attach` then takes the result,
waiting for it if the download is the slower. The thread runs the poller's own `wait_for_head` and
`fetch_global` (the same checks, caps and errors as a fetch in `attach`); the poller's thread starts
only after `attach`, so nothing else touches the poller meanwhile. What the fetch raised is raised by
`result`, on the training thread.
"""

from __future__ import annotations

import threading

from speedtronic.diloco.bus.base import Head
from speedtronic.diloco.worker.overlap import Global
from speedtronic.diloco.worker.poller import Poller


class Prefetch:
    def __init__(self, poller: Poller) -> None:
        self._poller = poller
        self._fetched: tuple[Head, Global] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="speedtronic-diloco-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            head = self._poller.wait_for_head()
            self._fetched = (head, self._poller.fetch_global(head))
        except BaseException as error:  # raised again on the training thread, by result()
            self._error = error

    def result(self) -> tuple[Head, Global]:
        """The head and its global, once fetched; what the fetch raised, raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._fetched is not None
        return self._fetched
