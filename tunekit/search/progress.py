"""What a running search tells its user: the plan's size, progress bars on a terminal, progress lines
elsewhere, and on the CPU interpreter an estimate of the whole from the first measured trials.

Three modes (``Progress(mode, log, ...)``):

* ``"bars"`` (or True): rich progress bars, one per study (stdout is a terminal);
* ``"lines"``: one ``progress:`` line per finished study and at most one per :data:`LINE_INTERVAL_S`
  seconds between them, each with the studies and trials done of the plan, the time elapsed and an ETA
  (stdout is a pipe or a file: a log, a batch job);
* False / None: silent (``--no-progress``); messages still go to ``log``.

Call protocol (the search's threads share one object; every method is thread-safe)::

    bar = Progress("lines", log, studies=44, trials=40, workers=1, cpu=True)
    bar.plan(problems=44, backends=1)          # one line: the size, before the first trial
    task = bar.add("gemv m1 96x5120 triton", total=40, done=0)   # a study opened (done: already stored)
    bar.update(task, completed=1, best="...")  # a trial measured (completed: the study's measured trials)
    bar.finish(task)                           # the study needs no more trials (also when short of total)
    bar.log("message"); bar.stop()

On the CPU (``cpu=True``) the first measured trial gives an estimate of the rest (one line), refined once
:data:`REFINE_AFTER` trials are measured: then a trial's time is the median of the trials so far (the first
one also pays the worker's warm-up, a trial that ends a study the wait for the next), each line saying how
many trials it rests on. A ``warning:`` line comes with the first estimate over :data:`HOURS_WARNING_S`
(once), saying how to make the search smaller. A trial's time is the time between two measured trials of
one worker thread (the first: since the start), so several workers are counted as they run.
Imports nothing of the search.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

#: Seconds between two ``progress:`` lines while no study finishes.
LINE_INTERVAL_S = 10.0
#: Measured trials after which the CPU estimate is given again from the median of the trials so far.
REFINE_AFTER = 5
#: A CPU search estimated longer than this gets a ``warning:`` line.
HOURS_WARNING_S = 3600.0
#: How to make a search smaller (the warning's advice).
SMALLER = ("make it smaller with --budget quick, --ops (fewer ops), --m 1 (fewer batch sizes) or --trials N "
           "(fewer per study), or run it on a GPU")


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``: a duration as a user reads it."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """Progress of one search: bars, lines or nothing (see the module docstring)."""

    def __init__(self, mode: bool | str | None, log: Callable[[str], None] = print, *, studies: int = 0,
                 trials: int = 0, workers: int = 1, cpu: bool = False, interval_s: float = LINE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.mode = "bars" if mode is True else (mode or None)
        if self.mode not in (None, "bars", "lines"):
            raise ValueError(f"progress mode {mode!r}")
        self._log = log
        self._lock = threading.Lock()
        self._clock = clock
        self._started = clock()
        self._last_line = self._started
        self._interval = interval_s
        self._studies, self._trials, self._workers, self._cpu = studies, trials, max(workers, 1), cpu
        self._total: dict[str, int] = {}  # task -> trials the study wants
        self._done: dict[str, int] = {}  # task -> measured trials it holds (capped at its total)
        self._finished: set[str] = set()
        self._measured_now = 0  # trials measured by this process (the ETA's rate)
        self._trial_s: list[float] = []  # each measured trial's time, per worker thread (the CPU estimate)
        self._last_trial: dict[int, float] = {}  # worker thread -> when its last measured trial ended
        self._warned = False
        self._bars = None
        self._bar_tasks: dict[str, Any] = {}
        if self.mode == "bars":
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bars = RichProgress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[best]}"),
            )
            self._bars.start()

    # ------------------------------------------------------------------ the plan
    def plan(self, problems: int, backends: int) -> None:
        """One line before the first trial: problems x backends = studies x trials."""
        text = (f"plan: {problems} problem(s) x {backends} backend(s) = {self._studies} studies x "
                f"{self._trials} trials = {self._studies * self._trials} trials at most (a resumed study "
                "measures only what it lacks)")
        if self._cpu:
            text += "; on the CPU interpreter the first trial gives an estimate of the whole"
        self.log(text)

    # ------------------------------------------------------------------ studies and trials
    def add(self, description: str, total: int, done: int) -> str:
        """The task of one study (one however many workers run its trials); ``done``: trials stored."""
        with self._lock:
            if description not in self._total:
                self._total[description] = total
                self._done[description] = min(done, total)
                if done >= total:
                    self._finished.add(description)  # resumed complete: nothing to report
            if self._bars is not None and description not in self._bar_tasks:
                self._bar_tasks[description] = self._bars.add_task(description, total=total, completed=done,
                                                                   best="")
        return description

    def update(self, task: str | None, completed: int, best: str = "") -> None:
        """A trial of ``task`` was measured; the study now holds ``completed`` measured trials."""
        if task is None:
            return
        lines: list[str] = []
        with self._lock:
            self._measured_now += 1
            now, thread = self._clock(), threading.get_ident()
            self._trial_s.append(now - self._last_trial.get(thread, self._started))
            self._last_trial[thread] = now
            self._done[task] = max(self._done.get(task, 0), min(completed, self._total.get(task, completed)))
            if self._bars is not None:
                self._bars.update(self._bar_tasks[task], completed=completed, best=best)
            if self._cpu and len(self._trial_s) in (1, REFINE_AFTER):
                lines += self._estimate()
            if self._done[task] >= self._total.get(task, completed) and task not in self._finished:
                self._finished.add(task)
                lines += self._line(f"study done: {task}")
            elif self._clock() - self._last_line >= self._interval:
                lines += self._line()
        for line in lines:
            self.log(line)

    def finish(self, task: str | None) -> None:
        """``task`` needs no more trials (its domain is exhausted, --timeout, or it is complete)."""
        if task is None:
            return
        with self._lock:
            if task in self._finished:
                return
            self._finished.add(task)
            self._total[task] = self._done.get(task, 0)  # the plan shrinks by what it will not measure
            lines = self._line(f"study done: {task}")
        for line in lines:
            self.log(line)

    # ------------------------------------------------------------------ text
    def _counts(self) -> tuple[int, int, int]:
        """(studies finished, trials done, trials planned): unopened studies count ``trials`` each."""
        planned = (self._studies - len(self._total)) * self._trials + sum(self._total.values())
        return len(self._finished), sum(self._done.values()), max(planned, 0)

    def _eta(self, left: int) -> str:
        elapsed = self._clock() - self._started
        if not self._measured_now or elapsed <= 0:
            return "ETA unknown until a trial is measured"
        return f"ETA {duration(left * elapsed / self._measured_now)}"

    def _line(self, prefix: str | None = None) -> list[str]:
        """The progress line (lines mode only); under the lock."""
        if self.mode != "lines":
            return []
        self._last_line = self._clock()
        finished, done, planned = self._counts()
        elapsed = self._clock() - self._started
        head = f"progress: {prefix}; " if prefix else "progress: "
        return [f"{head}{finished}/{self._studies} studies, {done}/{planned} trials, "
                f"{duration(elapsed)} elapsed, {self._eta(planned - done)}"]

    def _estimate(self) -> list[str]:
        """The CPU's estimate of the whole from the trials measured so far (the median's); under the lock."""
        count, per_trial = len(self._trial_s), statistics.median(self._trial_s)
        _, done, planned = self._counts()
        left = max(planned - done, 0)
        total = left * per_trial / self._workers
        took = (f"the first trial took {duration(per_trial)} on the CPU interpreter" if count == 1 else
                f"a trial takes {duration(per_trial)} on the CPU interpreter (the median of the first {count})")
        lines = [f"estimate: {took}; the {left} trials left would take about {duration(total)}"
                 + (f" over {self._workers} workers" if self._workers > 1 else "")
                 + (f" (from 1 trial; refined after {REFINE_AFTER})" if count == 1 else "")]
        if total > HOURS_WARNING_S and not self._warned:
            self._warned = True
            lines.append(f"warning: this CPU search would take about {duration(total)}: {SMALLER}")
        return lines

    # ------------------------------------------------------------------ messages
    def log(self, message: str) -> None:
        if self._bars is not None:
            self._bars.console.log(message)
        else:
            self._log(message)

    def stop(self) -> None:
        if self._bars is not None:
            self._bars.stop()
