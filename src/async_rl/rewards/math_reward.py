"""Rule-based math reward: answer extraction, equivalence checking, DAPO overlong penalty.

Strict by default, as verl's and DAPO's math graders are: only the content of the last closed, non-empty
``\\boxed{...}`` counts; spec §6's last-number fallback is the explicit option ``fallback_last_number``
(off in every recipe and in evaluation). One grading is bounded by ``timeout_s`` in every part and never
raises; the symbolic ``math_verify`` check runs in a pool of killable worker processes
(:class:`MathVerifier`), so it works from any thread. Entry points: :func:`extract_answer`,
:func:`is_equivalent`, :func:`grade_answer`, :func:`math_score`, :func:`reference_answer`,
:func:`overlong_penalty`.

Details: docs/tasks.md (Math reward); docs/evaluation.md (The math grader).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
import unicodedata
from decimal import Decimal, InvalidOperation
from pathlib import Path

__all__ = [
    "MAX_SYMBOLIC_CHARS",
    "MathVerifier",
    "extract_answer",
    "get_default_verifier",
    "grade_answer",
    "is_equivalent",
    "math_score",
    "overlong_penalty",
    "reference_answer",
]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------------------------------

# The two box commands a model writes its final answer in (`\boxed{..}`, `\fbox{..}`), as verl's and
# DAPO's `last_boxed_only_string` accept them.
_BOX_COMMANDS = ("\\boxed", "\\fbox")

# Inside a box only braces and backslash escapes matter; jumping between them with a regex keeps the
# brace matching linear and fast (the Python loop runs once per brace, not once per character).
_BRACE_OR_ESCAPE = re.compile(r"\\.|[{}]", re.DOTALL)

_SPACES = re.compile(r"\s*")

# `\boxed 5` (TeX's single-token argument, also in verl's grader): up to whitespace, `$` or a brace.
_SINGLE_TOKEN_ARGUMENT = re.compile(r"[^\s${}]+")

# A number token: optional minus (only when not a binary minus such as `3-5`), digits with optional
# thousands separators, optional decimals. Lookbehinds keep `x2` or `1.5`'s `5` from matching.
_NUMBER = re.compile(r"(?:(?<![\w)\]}.])-)?(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")

# How many regex matches run between two looks at the clock: at about a microsecond per match, a
# deadline is overshot by a few milliseconds at most, and the clock costs nothing measurable.
_CLOCK_EVERY = 4096

# Longest extracted answer that is sent to the symbolic check. Real answers (AIME, DAPO-Math, MATH) are
# a few dozen characters; anything longer is compared by the string fast paths only, so a megabyte box
# cannot tie up (and get killed in) a sympy worker.
MAX_SYMBOLIC_CHARS = 2000


class GraderTimeout(Exception):
    """The grading deadline passed during answer extraction (caught inside this module)."""


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise GraderTimeout


def _last_box_command(text: str) -> int | None:
    """Index just after the name of the last ``\\boxed`` / ``\\fbox`` command in ``text``, or None.

    A longer control word (``\\boxedfoo``) is not the command: TeX ends a command name at the first
    non-letter. Each command's occurrences are found right to left with ``rfind``, every character is
    looked at a bounded number of times, so this is linear even for a megabyte of ``\\boxed{``.
    """
    positions = {command: text.rfind(command) for command in _BOX_COMMANDS}
    while True:
        command = max(positions, key=positions.__getitem__)
        start = positions[command]
        if start < 0:
            return None
        after = start + len(command)
        if after == len(text) or not (text[after].isascii() and text[after].isalpha()):
            return after
        positions[command] = text.rfind(command, 0, start)


def _braced_content(text: str, open_index: int, deadline: float | None) -> str | None:
    """Content between ``text[open_index] == '{'`` and its matching ``}``; None if never closed.

    Escaped braces (``\\{``, ``\\}``) are content, not nesting, so ``\\boxed{\\{1,2\\}}`` works.
    """
    depth = 0
    for count, match in enumerate(_BRACE_OR_ESCAPE.finditer(text, open_index)):
        if count % _CLOCK_EVERY == _CLOCK_EVERY - 1:
            _check_deadline(deadline)
        char = text[match.start()]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : match.start()]
    return None


def _last_box_content(text: str, deadline: float | None) -> str | None:
    """Stripped content of the LAST box command; None when there is none, or it is unclosed or empty."""
    index = _last_box_command(text)
    if index is None:
        return None
    index = _SPACES.match(text, index).end()  # `\boxed {..}`
    if index < len(text) and text[index] == "{":
        content = _braced_content(text, index, deadline)
    else:
        token = _SINGLE_TOKEN_ARGUMENT.match(text, index)
        content = token.group(0) if token else None
    if content is None or not content.strip():
        return None
    return content.strip()


def _last_number(text: str, deadline: float | None) -> str | None:
    last = None
    for count, match in enumerate(_NUMBER.finditer(text)):
        if count % _CLOCK_EVERY == _CLOCK_EVERY - 1:
            _check_deadline(deadline)
        last = match
    return None if last is None else last.group(0).replace(",", "")


def _extract(text: str | None, fallback_last_number: bool, deadline: float | None) -> str | None:
    """:func:`extract_answer` with an absolute deadline; raises GraderTimeout when it passes."""
    if not text:
        return None
    if not isinstance(text, str):
        raise TypeError(f"the response to grade must be text, got {type(text).__name__}")
    boxed = _last_box_content(text, deadline)
    if boxed is not None or not fallback_last_number:
        return boxed
    return _last_number(text, deadline)


def extract_answer(
    text: str | None, fallback_last_number: bool = False, timeout_s: float | None = None
) -> str | None:
    """Extract the final answer from a model response (spec §6, made strict as in the DAPO/verl graders).

    Strict rule (the default): the content of the LAST ``\\boxed{...}`` / ``\\boxed {...}`` /
    ``\\boxed 5`` / ``\\fbox{...}`` (nested and escaped braces handled), or None when the response has no
    box, or its last box is never closed (a response cut off at the length limit) or empty. An earlier
    box does not stand in for a broken last one: the model's last word is its answer.

    ``fallback_last_number=True`` adds the spec §6 fallback: when the strict rule finds nothing, the last
    number in the text (an optional leading minus unless it is a binary minus as in ``3-5``; ``1,000`` ->
    ``1000``; a decimal kept whole, ``3.5``). Off in every recipe and in evaluation: it pays for any
    number the model happens to write last (docs/evaluation.md, "The math grader").

    Linear in ``len(text)``. With ``timeout_s`` the extraction gives up (returns None) once that many
    seconds have passed; it never raises on any text.
    """
    deadline = None if timeout_s is None else time.monotonic() + _positive_timeout(timeout_s)
    try:
        return _extract(text, fallback_last_number, deadline)
    except GraderTimeout:
        logger.warning("answer extraction gave up after %g s on a %d-character response", timeout_s, len(text))
        return None


def _positive_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


# --------------------------------------------------------------------------------------------------
# Normalisation and fast paths
# --------------------------------------------------------------------------------------------------

_LATEX_NOISE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |~")
_INTEGER = re.compile(r"[+-]?\d+")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _strip_math_delimiters(text: str) -> str:
    text = text.strip()
    for opener, closer in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) >= len(opener) + len(closer) and text.startswith(opener) and text.endswith(closer):
            text = text[len(opener) : len(text) - len(closer)].strip()
    return text


def _normalize(text: str) -> str:
    """Cheap canonical form for the string fast path (never used to decide 'not equal')."""
    text = _strip_math_delimiters(text)
    text = _LATEX_NOISE.sub("", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\s+", "", text)
    text = text.rstrip(".")
    if _THOUSANDS.search(text) and re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    return text


def _canonical_integer(text: str) -> str:
    """Sign and digits without leading zeros, compared as text: ``int()`` refuses more than 4,300 digits
    (Python's int-string limit) and would raise on a model's 5,000-digit answer."""
    negative = text.startswith("-")
    digits = text.lstrip("+-")
    if not digits.isascii():  # `\d` also matches other scripts' digits (`٢٠٤` is 204)
        digits = "".join(str(unicodedata.decimal(char)) for char in digits)
    digits = digits.lstrip("0") or "0"
    return "-" + digits if negative and digits != "0" else digits


def _fast_path(pred: str, label: str) -> bool | None:
    """True/False when decidable without sympy, else None."""
    norm_pred, norm_label = _normalize(pred), _normalize(label)
    if not norm_pred:
        return False
    if norm_pred == norm_label:
        return True
    if _INTEGER.fullmatch(norm_pred) and _INTEGER.fullmatch(norm_label):
        return _canonical_integer(norm_pred) == _canonical_integer(norm_label)  # `025` == `25`, `-0` == `0`
    if _PLAIN_NUMBER.fullmatch(norm_pred) and _PLAIN_NUMBER.fullmatch(norm_label):
        try:
            if Decimal(norm_pred) == Decimal(norm_label):  # `0.50` == `.5`
                return True
        except InvalidOperation:
            pass
        # Unequal decimals still go to math_verify, which applies its rounding tolerance.
    return None


# --------------------------------------------------------------------------------------------------
# Worker process side
# --------------------------------------------------------------------------------------------------


def _symbolic_equal(pred: str, label: str) -> bool:
    """The math_verify check proper. Runs inside a worker process (no timeouts of its own)."""
    from math_verify import parse, verify

    # Wrapping in `$...$` routes both strings through math_verify's LaTeX extractor, which also
    # accepts plain expressions (`1/2`, `0.5`) and handles `10\%`, `50^\circ`, `\text{(B)}`.
    gold = parse(f"${_strip_math_delimiters(label)}$", parsing_timeout=None)
    guess = parse(f"${_strip_math_delimiters(pred)}$", parsing_timeout=None)
    if not gold or not guess:
        return False
    return bool(verify(gold, guess, timeout_seconds=None))  # gold first: verify is not symmetric


def _verifier_worker_loop() -> None:
    """Entry point of a worker process: JSON lines in on stdin, JSON lines out on stdout."""
    protocol_out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # stray prints from libraries must not corrupt the protocol stream
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # silences "timeout is disabled"
    memory_limit_mb = int(os.environ.get("ASYNC_RL_VERIFIER_MEMORY_MB", "0") or 0)
    if memory_limit_mb > 0:
        import resource

        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import math_verify  # noqa: F401 - pay the sympy import before announcing readiness

    protocol_out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        try:
            request = json.loads(line)
            answer = {"equal": _symbolic_equal(request["pred"], request["label"])}
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            answer = {"equal": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        protocol_out.write(json.dumps(answer) + "\n")


# --------------------------------------------------------------------------------------------------
# Caller side: the pool
# --------------------------------------------------------------------------------------------------


# The worker loads this file by path instead of importing ``async_rl``: the package's __init__ pulls in
# verl/torch (seconds and hundreds of MB per worker) and nothing here needs it. Only the standard library
# and math_verify are imported.
_WORKER_BOOTSTRAP = (
    "import importlib.util as u, sys\n"
    "s = u.spec_from_file_location('_async_rl_math_verifier', sys.argv[1])\n"
    "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m)\n"
    "m._verifier_worker_loop()\n"
)


class _WorkerDied(RuntimeError):
    pass


class _VerifierWorker:
    """One worker process plus a line reader with deadlines."""

    def __init__(self, memory_limit_mb: int) -> None:
        """Spawn the process; it is usable once :meth:`wait_ready` returned True."""
        env = dict(os.environ)
        env["ASYNC_RL_VERIFIER_MEMORY_MB"] = str(memory_limit_mb)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOTSTRAP, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        self._buffer = b""

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the worker has imported math_verify; False if not within ``timeout_s``."""
        ready = self.read_message(timeout_s)
        if ready is None:
            return False
        if not ready.get("ready"):
            raise _WorkerDied(f"math verifier worker sent {ready!r} instead of its ready line")
        return True

    def read_message(self, timeout_s: float) -> dict | None:
        """Next JSON line from the worker, or None on timeout. Raises _WorkerDied on EOF."""
        deadline = time.monotonic() + timeout_s
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                return None
            try:
                chunk = os.read(fd, 65536)
            except OSError as exc:
                raise _WorkerDied(f"cannot read from the math verifier worker: {exc}") from exc
            if not chunk:
                raise _WorkerDied(f"math verifier worker exited (code {self.process.poll()})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            message = json.loads(line)
        except ValueError as exc:  # a corrupt protocol stream: this worker cannot be trusted any more
            raise _WorkerDied(f"math verifier worker sent a non-JSON line {line[:80]!r}") from exc
        if not isinstance(message, dict):
            raise _WorkerDied(f"math verifier worker sent {message!r:.80} instead of an object")
        return message

    def check(self, pred: str, label: str, timeout_s: float) -> dict | None:
        try:
            self.process.stdin.write((json.dumps({"pred": pred, "label": label}) + "\n").encode())
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise _WorkerDied(f"math verifier worker is gone: {exc}") from exc
        return self.read_message(timeout_s)

    def kill(self) -> None:
        """Hard kill (SIGKILL): a runaway sympy computation does not react to anything softer."""
        try:
            self.process.kill()
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not get ignored
            logger.warning("math verifier worker %d did not die after SIGKILL", self.process.pid)
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


class MathVerifier:
    """Thread-safe pool of math_verify worker processes with a hard per-check timeout.

    Args:
        max_workers: concurrent checks (each worker is a process of ~100 MB that imports sympy).
        memory_limit_mb: RLIMIT_AS of each worker, so a pathological expression cannot eat the host;
            0 disables the limit.
        startup_timeout_s: how long a new worker may take to import math_verify. A check waits for a
            starting worker only as long as its own ``timeout_s`` allows; the start itself goes on (in a
            background thread) up to this limit, and the worker then serves later checks.

    Attributes:
        stats: counters ``checks``, ``timeouts``, ``worker_errors`` (for logging / metrics).
    """

    def __init__(self, max_workers: int = 2, memory_limit_mb: int = 4096, startup_timeout_s: float = 120.0) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.memory_limit_mb = memory_limit_mb
        self.startup_timeout_s = startup_timeout_s
        self._slots = threading.BoundedSemaphore(max_workers)
        self._idle: queue.LifoQueue[_VerifierWorker] = queue.LifoQueue()
        self._lock = threading.Lock()
        self._starting = 0  # workers being started (at most max_workers)
        self._closed = False
        self._owner_pid = os.getpid()
        self.stats = {"checks": 0, "timeouts": 0, "worker_errors": 0}

    def equal(self, pred: str, label: str, timeout_s: float = 5.0) -> bool:
        """Symbolic equivalence of ``pred`` to ``label`` via math_verify; False on timeout or error.

        ``timeout_s`` covers everything the caller waits for: a free slot, a worker (one is started
        when none is idle; a start that outlives the limit goes on in the background and the worker
        joins the pool for later checks) and the check itself.
        """
        if self._closed:
            raise RuntimeError("MathVerifier is closed; create a new one")
        if os.getpid() != self._owner_pid:
            # Forked child: the inherited pipes belong to the parent's workers. Start over.
            self.__init__(self.max_workers, self.memory_limit_mb, self.startup_timeout_s)  # type: ignore[misc]
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not self._slots.acquire(timeout=max(0.0, timeout_s)):
            self._count("timeouts")
            logger.warning("no math verifier worker became free within %g s (max_workers=%d); counted as wrong",
                           timeout_s, self.max_workers)
            return False
        try:
            answer = self._check_with_a_worker(pred, label, deadline, timeout_s)
        finally:
            self._slots.release()
        if answer and answer.get("error"):
            logger.debug("math_verify error: %s", answer["error"])
        return bool(answer and answer.get("equal"))

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _check_with_a_worker(self, pred: str, label: str, deadline: float, timeout_s: float) -> dict | None:
        """One check on an idle (or newly started) worker; the caller holds a slot. None on timeout/failure."""
        try:
            worker = self._idle.get_nowait()
        except queue.Empty:
            self._start_workers_in_background(1)
            try:
                worker = self._idle.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._count("timeouts")
                logger.warning("no math verifier worker was ready within %g s; counted as wrong", timeout_s)
                return None
        healthy = True
        try:
            answer = worker.check(pred, label, max(0.0, deadline - time.monotonic()))
        except _WorkerDied as exc:
            healthy, answer = False, None
            self._count("worker_errors")
            logger.warning("math verifier worker died on pred=%.80r label=%.80r: %s", pred, label, exc)
        self._count("checks")
        if healthy and answer is None:
            healthy = False
            self._count("timeouts")
            logger.warning("math_verify timed out after %g s on pred=%.80r label=%.80r", timeout_s, pred, label)
        if healthy:
            self._return_idle(worker)
        else:
            worker.kill()
        return answer

    def _return_idle(self, worker: _VerifierWorker) -> None:
        with self._lock:
            keep = not self._closed and self._idle.qsize() < self.max_workers
            if keep:
                self._idle.put(worker)
        if not keep:
            worker.kill()

    def _start_one(self) -> None:
        """Start a worker and put it into the idle pool (runs in a starter thread)."""
        try:
            worker = _VerifierWorker(self.memory_limit_mb)
        except Exception as exc:  # noqa: BLE001 - OSError from Popen, or anything else: still release below
            worker = None
            failure = f"{type(exc).__name__}: {exc}"
        else:
            try:
                ready = worker.wait_ready(self.startup_timeout_s)
                failure = "" if ready else f"it did not start within {self.startup_timeout_s:g} s"
            except Exception as exc:  # noqa: BLE001 - any failure must still release the start count below
                failure = f"{type(exc).__name__}: {exc}"
        try:
            if failure:
                self._count("worker_errors")
                logger.error("cannot start math verifier worker: %s", failure)
                if worker is not None:
                    worker.kill()
            else:
                self._return_idle(worker)
        finally:
            with self._lock:  # only now: warm_up() waits while starts are under way and none is idle yet
                self._starting -= 1

    def _start_workers_in_background(self, count: int) -> list[threading.Thread]:
        """Start up to ``count`` workers, keeping idle + starting workers within ``max_workers``."""
        with self._lock:
            if self._closed:
                return []
            count = max(0, min(count, self.max_workers - self._starting - self._idle.qsize()))
            self._starting += count
        starters = [threading.Thread(target=self._start_one, name="math-verifier-start", daemon=True)
                    for _ in range(count)]
        for starter in starters:
            starter.start()
        return starters

    def warm_up(self, workers: int | None = None) -> int:
        """Start up to ``workers`` (default: all) idle workers now, in parallel, so the first checks do
        not pay the sympy import. Returns how many idle workers there are afterwards."""
        target = min(self.max_workers, workers or self.max_workers)
        for starter in self._start_workers_in_background(target - self._idle.qsize()):
            starter.join()
        # Starts already under way (begun by a check) count towards the target too: wait for them.
        give_up = time.monotonic() + self.startup_timeout_s
        while self._idle.qsize() < target and self._starting > 0 and time.monotonic() < give_up:
            time.sleep(0.05)
        return self._idle.qsize()

    def close(self) -> None:
        """Kill idle workers; busy or starting ones are killed when they come back."""
        with self._lock:
            self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                break


_default_verifier: MathVerifier | None = None
_default_verifier_lock = threading.Lock()


def get_default_verifier() -> MathVerifier:
    """The process-wide pool used by :func:`is_equivalent` (created on first use, closed at exit)."""
    global _default_verifier
    with _default_verifier_lock:
        if _default_verifier is None or _default_verifier._closed:
            _default_verifier = MathVerifier()
            atexit.register(_default_verifier.close)
        return _default_verifier


def is_equivalent(pred: str | None, label: str, timeout_s: float = 5.0, verifier: MathVerifier | None = None) -> bool:
    """Is the extracted answer ``pred`` mathematically equal to the reference ``label``?

    Fast paths (no subprocess): normalised string equality, integer comparison (``025`` == ``25``, any
    number of digits), equal plain decimals. Everything else goes to math_verify in a worker process that
    is killed after ``timeout_s`` seconds (then the answer counts as not equivalent); a ``pred`` longer
    than ``MAX_SYMBOLIC_CHARS`` never does (not equivalent). Safe in any thread; never raises on ``pred``.
    """
    _positive_timeout(timeout_s)
    if pred is None or not str(pred).strip():
        return False
    pred = str(pred)
    if not isinstance(label, str):
        label = str(label)
    decided = _fast_path(pred, label)
    if decided is not None:
        return decided
    if len(pred) > MAX_SYMBOLIC_CHARS:
        return False
    return (verifier or get_default_verifier()).equal(pred, label, timeout_s)


def reference_answer(label: object) -> str:
    """The reference answer as text; a label holding a ``\\boxed{..}`` (a whole solution) is reduced to
    its last box. Raises ValueError on an empty label: that is a dataset bug, not a wrong answer."""
    if label is None or not str(label).strip():
        raise ValueError("the math grader needs a non-empty reference label; check the dataset's answer field")
    text = str(label).strip()
    if "\\boxed" in text or "\\fbox" in text:
        text = extract_answer(text) or text
    return text


def grade_answer(
    response: str | None,
    label: object,
    timeout_s: float = 5.0,
    verifier: MathVerifier | None = None,
    fallback_last_number: bool = False,
) -> tuple[str | None, bool]:
    """``(extracted answer or None, correct)`` for one response; the grader behind :func:`math_score`
    and the math / ReTool envs.

    ``timeout_s`` bounds the whole grading of the response: extraction (linear, checked against the
    clock) and the symbolic check get what is left of it. Any response text, however long or odd,
    gives a result and never an exception; running out of time counts as wrong.
    """
    deadline = time.monotonic() + _positive_timeout(timeout_s)
    label = reference_answer(label)
    try:
        pred = _extract(response, fallback_last_number, deadline)
    except GraderTimeout:
        logger.warning("answer extraction ran out of its %g s on a %d-character response", timeout_s, len(response))
        return None, False
    if pred is None:
        return None, False
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return pred, False
    return pred, is_equivalent(pred, label, timeout_s=remaining, verifier=verifier)


def math_score(
    response: str | None,
    label: object,
    timeout_s: float = 5.0,
    verifier: MathVerifier | None = None,
    fallback_last_number: bool = False,
) -> float:
    """1.0 when the answer extracted from ``response`` equals ``label``, else 0.0 (also when no answer).

    Strict by default (the last ``\\boxed{}`` only, see :func:`extract_answer`); a ``label`` that itself
    contains ``\\boxed{..}`` is reduced to the boxed content first. See :func:`grade_answer`.
    """
    _, correct = grade_answer(response, label, timeout_s, verifier, fallback_last_number)
    return 1.0 if correct else 0.0


# --------------------------------------------------------------------------------------------------
# DAPO soft overlong punishment
# --------------------------------------------------------------------------------------------------


def overlong_penalty(
    response_length: int, max_response_length: int, cache_fraction: float = 0.25, penalty: float = 1.0
) -> float:
    """DAPO's soft overlong punishment, added to the task reward.

    With ``L_max = max_response_length`` and ``L_cache = cache_fraction * L_max`` (not rounded):

    * ``length <= L_max - L_cache``            -> ``0.0`` (the boundary itself is free);
    * ``L_max - L_cache < length <= L_max``    -> ``-penalty * (length - (L_max - L_cache)) / L_cache``,
      a straight line from 0 (exclusive) down to exactly ``-penalty`` at ``length == L_max``;
    * ``length > L_max``                        -> ``-penalty``.

    Example (L_max=100, cache_fraction=0.25): 75 -> 0.0, 76 -> -0.04, 100 -> -1.0, 150 -> -1.0.
    """
    if max_response_length <= 0:
        raise ValueError(f"max_response_length must be positive, got {max_response_length}")
    if not 0.0 < cache_fraction <= 1.0:
        raise ValueError(f"cache_fraction must be in (0, 1], got {cache_fraction}")
    if response_length < 0:
        raise ValueError(f"response_length must be >= 0, got {response_length}")
    cache_length = cache_fraction * max_response_length
    free_length = max_response_length - cache_length
    if response_length <= free_length:
        return 0.0
    if response_length >= max_response_length:
        return -float(penalty)
    return -float(penalty) * (response_length - free_length) / cache_length
