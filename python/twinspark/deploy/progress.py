"""Progress of the deploy commands, through rich on stderr. A terminal gets live bars and a spinner; anything else
(a pipe, CI, a test) gets plain lines: one when a step starts and ends, a transfer line every PLAIN_EVERY_S
seconds and at its end, a boot line when a rank's phase changes. So a log shows the same progress a user sees.

Contract:
  fmt_bytes(n) -> "48.0 MiB";  fmt_s(seconds) -> "2 min 5 s"
  Transfer(what, total) (context manager): .update(done) with the bytes done so far, .watch(fn) polls fn() for them
  Phase(what) (context manager): .set(text) the current state of a long wait (the boot phase of each rank)
  Steps(): .step(name, resume) times a step; Ctrl-C inside it raises Interrupted, one sentence saying which step
      was cut, what it left and how to go on (`resume`, text or a function giving it); .table() the step times
  watch_interrupts() (context manager): Ctrl-C also turns into Interrupted when a child (rsync, ssh) saw the
      signal first and its failure reached Python before the KeyboardInterrupt did
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from twinspark.deploy.errors import DeployError

PLAIN_EVERY_S = 10.0
UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_console = None
_sigint = threading.Event()


class Interrupted(DeployError):
    """Ctrl-C: the sentence says what state was left and how to resume; the command exits 130."""

    code = 130


def console():
    global _console
    if _console is None:
        from rich.console import Console

        _console = Console(stderr=True, soft_wrap=True, highlight=False)
    return _console


def live() -> bool:
    return console().is_terminal


def line(text: str) -> None:
    console().print(text, markup=False, highlight=False)


def fmt_bytes(n: float) -> str:
    """IEC units with one decimal above 1 KiB: '512 B', '1.0 MiB', '197.3 GiB'."""
    n = float(n)
    for unit in UNITS:
        if abs(n) < 1024 or unit == UNITS[-1]:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_s(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s} s" if m < 60 else f"{m // 60} h {m % 60} min"


class Transfer:
    """Bytes of one copy: a rich bar (bytes, rate, time left) in a terminal, else a line every PLAIN_EVERY_S."""

    def __init__(self, what: str, total: int | None = None):
        self.what, self.total = what, total or None
        self.done, self.first = 0, None
        self.t0 = self.last_line = time.monotonic()
        self._bar = self._task = None
        self._stop = threading.Event()
        self._thread = None
        self._lock = threading.Lock()

    def __enter__(self) -> Transfer:
        if live():
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=console())
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total)
        return self

    def update(self, done: int, total: int | None = None) -> None:
        with self._lock:
            self.total = total or self.total
            self.first = done if self.first is None else self.first
            self.done = done
            if self._bar is not None:
                self._bar.update(self._task, completed=done, total=self.total)
            elif time.monotonic() - self.last_line >= PLAIN_EVERY_S:
                self.last_line = time.monotonic()
                line(self.text())

    def watch(self, fn: Callable[[], int | None], every: float = 0.5) -> None:
        """Poll fn() (bytes done, None: unknown now) in a thread until the context ends."""
        def loop():
            while not self._stop.wait(every):
                try:
                    v = fn()
                except OSError:
                    v = None
                if v is not None:
                    self.update(v)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def text(self) -> str:
        elapsed = time.monotonic() - self.t0
        rate = (self.done - (self.first or 0)) / elapsed if elapsed > 0 else 0.0
        out = f"{self.what}: {fmt_bytes(self.done)}"
        if self.total:
            out += f" of {fmt_bytes(self.total)} ({min(100.0, 100 * self.done / self.total):.0f}%)"
        out += f", {fmt_bytes(rate)}/s"
        if self.total and rate > 0 and self.done < self.total:
            out += f", about {fmt_s((self.total - self.done) / rate)} left"
        return out

    def __exit__(self, exc_type, *_) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._bar is not None:
            self._bar.stop()
        elif exc_type is None and self.done:
            line(self.text())


class Phase:
    """A long wait whose state changes (the boot): a spinner in a terminal, else a line per change (and one every
    PLAIN_EVERY_S * 3 while nothing changes, so a log shows it is still waiting)."""

    def __init__(self, what: str):
        self.what, self.t0 = what, time.monotonic()
        self.text, self.last_line = "", 0.0
        self._status = None

    def __enter__(self) -> Phase:
        if live():
            self._status = console().status(self.what)
            self._status.start()
        return self

    def set(self, text: str) -> None:
        now = time.monotonic()
        shown = f"{self.what} {fmt_s(now - self.t0)}: {text}"
        if self._status is not None:
            self._status.update(shown)
        elif text != self.text or now - self.last_line >= 3 * PLAIN_EVERY_S:
            self.last_line = now
            line(shown)
        self.text = text

    def __exit__(self, *_) -> None:
        if self._status is not None:
            self._status.stop()


@dataclass
class StepTime:
    name: str
    seconds: float
    result: str


class Steps:
    """quiet: no line at a step's start and end (a command of one step); Ctrl-C still says what was left."""

    def __init__(self, quiet: bool = False):
        self.times: list[StepTime] = []
        self.quiet = quiet

    @contextmanager
    def step(self, name: str, resume: str | Callable[[], str]):
        if not self.quiet:
            line(f"-- {name}")
        t0 = time.monotonic()
        result = "failed"
        try:
            yield
            result = "done"
        except KeyboardInterrupt:
            result = "interrupted"
            raise self._interrupted(name, t0, resume) from None
        except DeployError as e:
            if _sigint.is_set() and not isinstance(e, Interrupted):  # a child saw Ctrl-C first
                result = "interrupted"
                raise self._interrupted(name, t0, resume) from None
            raise
        finally:
            seconds = time.monotonic() - t0
            self.times.append(StepTime(name, seconds, result))
            if result == "done" and not self.quiet:
                line(f"   {name}: {fmt_s(seconds)}")

    @staticmethod
    def _interrupted(name: str, t0: float, resume) -> Interrupted:
        what = resume() if callable(resume) else resume
        return Interrupted(f"Interrupted during {name} after {fmt_s(time.monotonic() - t0)}: {what}.")

    def table(self):
        from rich.table import Table

        t = Table(title="steps", title_justify="left")
        for col in ("step", "time", "result"):
            t.add_column(col)
        for x in self.times:
            t.add_row(x.name, fmt_s(x.seconds), x.result)
        return t


@contextmanager
def watch_interrupts():
    """Remember a Ctrl-C (SIGINT) while the block runs, then raise KeyboardInterrupt as Python does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _sigint.clear()

    def handler(signum, frame):
        _sigint.set()
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
