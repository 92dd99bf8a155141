"""One progress display per phase of a run: the warm start, the build, training, an evaluation.

Every phase shows itself the same way (:class:`Phase`): a line when it starts, one when it ends with its
duration, and, for a phase that counts something (SFT steps, RL steps, eval samples), progress with the rate and
an ETA: a tqdm bar on a terminal, plain lines (:class:`ProgressLines`' cadence) when stdout is a log, a pipe or
CI. In a CLI run the plain lines also reach ``train.log`` while the terminal shows the bar
(:func:`async_rl.run_log.log_only`).

Standard library only (tqdm is imported when a bar is drawn).
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO


class ProgressLines:
    """When a plain progress line is due, and its timing part.

    A line is due on the first and the last step, every ``every_steps`` steps, and on any step that ends
    ``every_s`` seconds or more after the previous line: a fast run (toy tasks, ~0.1 s a step) prints
    every 10 steps, a slow one (ALFWorld, ~15 s a step) every step, so a log never goes quiet for long.
    """

    def __init__(self, total_steps: int, every_s: float = 10.0, every_steps: int = 10, clock=time.monotonic):
        self.total_steps = int(total_steps)
        self.every_s = float(every_s)
        self.every_steps = int(every_steps)
        self.clock = clock
        self.started = clock()
        self.last_line_at: float | None = None
        self.first_step: int | None = None

    def due(self, step: int) -> bool:
        now = self.clock()
        if self.first_step is None:
            self.first_step = step
        due = (self.last_line_at is None or step >= self.total_steps or step % self.every_steps == 0
               or now - self.last_line_at >= self.every_s)
        if due:
            self.last_line_at = now
        return due

    def timing(self, step: int, unit: str = "step") -> str:
        """``"10.0 s/step, elapsed 30 s, eta 370 s"``: this process's rate (a resumed run counts from its
        checkpoint's step), the time since the display started, and what is left at that rate. Faster than
        10 a second reads as ``"25 steps/s"``."""
        elapsed = self.clock() - self.started
        done = step - (self.first_step - 1 if self.first_step is not None else 0)
        if done < 1:  # nothing timed yet (a count that started at this step): no rate to show
            return f"elapsed {elapsed:.0f} s"
        per_step = elapsed / done
        eta = per_step * max(self.total_steps - step, 0)
        rate = f"{per_step:.1f} s/{unit}" if per_step >= 0.1 or per_step == 0 else f"{1 / per_step:.0f} {unit}s/s"
        return f"{rate}, elapsed {elapsed:.0f} s, eta {eta:.0f} s"


def _terminal() -> bool:
    return sys.stderr.isatty() and sys.stdout.isatty()


class Phase:
    """One phase's display: ``"<name>: <detail>"`` when it starts, progress while it counts, and
    ``"<name>: done in 12.3 s"`` when it ends (``"failed after 12.3 s (ValueError)"`` when it raises an error,
    ``"stopped after 12.3 s"`` on a signal: a ``BaseException`` that is not an ``Exception``, or one of ``stopped_by``).

    ``total``: how many ``unit``\\ s the phase counts (None: only a start and an end line, unless :meth:`update`
    gives one). ``terminal``: draw a tqdm bar (stderr) instead of printing progress lines; None decides from
    stdout and stderr. The start, end and plain progress lines are printed to ``stream`` (None: stdout, so a CLI
    run's ``train.log`` holds them); while a bar is drawn the progress lines go to ``log_only`` instead (None:
    ``train.log`` only). ``every_s``, ``every_steps``: a line every so many seconds or counts (None: every
    tenth of ``total``), as :class:`ProgressLines`.
    """

    def __init__(self, name: str, total: Optional[int] = None, unit: str = "step", detail: str = "",
                 terminal: Optional[bool] = None, every_s: float = 10.0, every_steps: Optional[int] = None,
                 clock=time.monotonic,
                 log_only: Optional[Callable[[str], None]] = None, stream: Optional[TextIO] = None,
                 stopped_by: tuple[type[BaseException], ...] = ()):
        self.name, self.total, self.unit, self.detail = name, total, unit, detail
        self.stream = stream  # None: sys.stdout at the time of printing (a CLI run's tee into train.log)
        self.terminal = _terminal() if terminal is None else terminal
        self.clock = clock
        self.every_s, self.every_steps = every_s, every_steps
        if log_only is None:
            from async_rl.run_log import log_only
        self.log_only = log_only
        self.stopped_by = stopped_by  # exceptions that stop the phase on purpose (a signal): "stopped", not "failed"
        self.lines: Optional[ProgressLines] = None
        self._resumed_at: Optional[int] = None
        self.bar = None
        self.started: Optional[float] = None

    def __enter__(self) -> "Phase":
        self.started = self.clock()
        self._print(f"{self.name}: {self.detail or 'started'}")
        if self.total is not None:
            self._count(self.total)
        return self

    def _print(self, line: str) -> None:
        print(line, file=self.stream or sys.stdout, flush=True)

    def _count(self, total: int, first_done: Optional[int] = None) -> None:
        """Start counting to ``total``. ``first_done``: the count is learnt at an update that already reports this
        many done (the warm start's steps are known once it runs): the rate is timed from that update on, so the
        setup before it (loading, demonstrations) does not inflate it."""
        self.total = int(total)
        every_steps = self.every_steps or max(1, round(self.total / 10))
        self.lines = ProgressLines(self.total, self.every_s, every_steps, clock=self.clock)
        if first_done is None:
            self.lines.started = self.started
            self.lines.first_step = (self._resumed_at or 0) + 1  # counted from 0, or from a resumed step
        else:
            self.lines.started = self.clock()
            self.lines.first_step = max(first_done, self._resumed_at or 0) + 1
        if self.terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=self.name, unit=self.unit, dynamic_ncols=True, leave=False)

    def start_at(self, done: int) -> None:
        """A resumed phase: ``done`` were finished by an earlier process (the rate counts this one's only)."""
        self._resumed_at = int(done)
        if self.lines is not None:
            self.lines.first_step = done + 1
        if self.bar is not None:
            self.bar.update(done - self.bar.n)

    def update(self, done: int, text: str = "", total: Optional[int] = None) -> None:
        """``done`` of ``total`` are finished; ``text`` (``"loss 1.23"``) goes on the line or the bar. ``total``:
        for a phase that learns its count once it runs (the warm start's steps are the task's defaults)."""
        if self.lines is None:
            if total is None:
                return
            self._count(total, first_done=done)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if text:
                self.bar.set_postfix_str(text, refresh=False)
        if self.lines.due(done):
            line = self.line(done, text)
            if self.bar is not None:
                self.log_only(line)
            else:
                self._print(line)

    def line(self, done: int, text: str = "") -> str:
        """``"training: 3/40 steps acc 0.25 | 10.0 s/step, elapsed 30 s, eta 370 s"``."""
        return (f"{self.name}: {done}/{self.total} {self.unit}s" + (f" {text}" if text else "")
                + f" | {self.lines.timing(done, self.unit)}")

    def __exit__(self, kind, error, traceback) -> None:
        if self.bar is not None:
            self.bar.close()
        took = self.clock() - self.started
        if kind is None:
            self._print(f"{self.name}: done in {took:.1f} s")
        elif issubclass(kind, Exception) and not issubclass(kind, self.stopped_by):
            self._print(f"{self.name}: failed after {took:.1f} s ({kind.__name__})")
        else:  # a signal (KeyboardInterrupt, the trainer's RunStopped): the caller prints what happens next
            self._print(f"{self.name}: stopped after {took:.1f} s")


def quiet_library_output() -> None:
    """One progress display per phase: the libraries' own per-load bars ("Loading weights", once per model copy)
    and huggingface_hub's per-save INFO line (once per checkpoint, as each refreshes the exported model) would
    interleave with the run's progress lines; warnings and errors still pass."""
    import logging

    logging.getLogger("huggingface_hub").setLevel(logging.WARNING)
    try:  # its serialization module names its logger by file path, outside the "huggingface_hub" hierarchy
        import huggingface_hub.serialization._torch as hf_torch_serialization

        hf_torch_serialization.logger.setLevel(logging.WARNING)
    except (ImportError, AttributeError):  # pragma: no cover - another huggingface_hub layout: the line stays
        pass
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass
