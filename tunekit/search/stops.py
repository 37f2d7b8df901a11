"""The signals that stop a search (Ctrl-C, SIGTERM, SIGHUP): their handlers only record them, and the search
raises the stop at points of its own.

A handler that raises does so wherever the main thread happens to be when the signal lands, a finalizer or a
library's cleanup callback included (SQLAlchemy's ``_collection_gced``): there Python prints "Exception
ignored in ..." and drops the exception, so the stop is lost and the search runs on to exit 0. While a search
runs (:meth:`Stops.recorded`), the handler of each stop signal whose handler is Python's (the CLI's, Python's
``default_int_handler`` for Ctrl-C, a caller's own) is replaced by :meth:`Stops.handler`, which writes the
signal's number into an attribute and nothing else: it cannot raise, block or take a lock. The search calls
:meth:`Stops.check` at each phase boundary (storage opened, workers started, device, probe, each trial, the
final re-measure, each file written), and every :data:`POLL_S` of its waits (a worker's reply, other workers'
trials in flight), so a stop is raised within about :data:`POLL_S` of its signal, in the main thread, at a
point where nothing swallows it; what it raises is what the displaced handler raises when called there (the
CLI's ``Interrupted``, Python's ``KeyboardInterrupt``). Imports nothing of tunekit.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

#: The signals that stop a search.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Longest slice of a wait of the search between two looks at a recorded stop (seconds).
POLL_S = 0.1


class Stops:
    """The stop signals of this process (one object, :data:`STOPS`: signal handlers are per process)."""

    def __init__(self) -> None:
        #: the signal recorded and not raised yet
        self.pending: int | None = None
        #: the first signal recorded since the outermost :meth:`recorded` began (the CLI names it)
        self.received: int | None = None
        self._actions: dict[int, Callable[[int, Any], Any]] = {}

    def handler(self, signum: int, frame: Any) -> None:
        """The handler of every stop signal while recorded: two attribute writes, never an exception."""
        if self.pending is None:
            self.pending = signum
        if self.received is None:
            self.received = signum

    def recording(self, signum: int) -> bool:
        return signal.getsignal(signum) == self.handler

    @contextlib.contextmanager
    def recorded(self, actions: dict[int, Callable[[int, Any], Any]] | None = None) -> Iterator[Stops]:
        """Within the block, each stop signal whose handler is Python's is only recorded; :meth:`check` then
        calls that handler (or ``actions[signum]``, the handler to act as) where the block checks. A signal
        under its default action (SIGTERM, SIGHUP outside the CLI) or ignored is left as it is. Nested
        blocks keep the outer one's. In a thread other than the main one (which gets no signal) it does
        nothing. On a normal exit, a signal recorded since the last check is acted on there."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        outermost = not any(self.recording(signum) for signum in SIGNALS)
        if outermost:
            self.pending = self.received = None
        displaced: dict[int, Any] = {}
        acting: dict[int, Callable[[int, Any], Any]] = {}
        for signum in SIGNALS:
            current = signal.getsignal(signum)
            if current == self.handler:
                continue  # an outer block records it
            action = (actions or {}).get(signum, current)
            if not callable(action):
                continue  # SIG_DFL, SIG_IGN, or a handler set outside Python (None)
            acting[signum] = action
            displaced[signum] = signal.signal(signum, self.handler)
        self._actions.update(acting)
        try:
            yield self
        finally:
            for signum, handler in displaced.items():
                # None: a handler set outside Python, which cannot be put back; Python's own is the nearest
                if handler is None:
                    handler = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
                signal.signal(signum, handler)
                del self._actions[signum]
        self._act(acting)  # reached on a normal exit only: a signal of the block's last moments is not lost

    def check(self) -> None:
        """Raise the recorded stop now (by calling the handler it displaced); nothing if none is recorded or
        off the main thread (a worker thread's search stops when the main thread raises)."""
        if self.pending is not None and threading.current_thread() is threading.main_thread():
            self._act(self._actions)

    def _act(self, actions: dict[int, Callable[[int, Any], Any]]) -> None:
        signum = self.pending
        if signum is None or signum not in actions:
            return
        self.pending = None
        actions[signum](signum, None)

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` that raises a recorded stop within :data:`POLL_S`."""
        deadline = time.monotonic() + seconds
        while True:
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, POLL_S))


#: This process's stop signals.
STOPS = Stops()
