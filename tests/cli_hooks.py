"""The trainer's CLI with a hook after a logged step, for the end-to-end interruption tests (tests/test_resume.py,
tests/test_resume_ray.py): ``python -c cli_after_step(ACTION) ARGS...`` runs ``async_rl.train.main(ARGS)`` with
``RunLogger.log`` wrapped so that, right after it logs step ``$AT_STEP``, it runs ``ACTION`` (Python statements
with ``os``, ``signal``, ``self`` (the logger) and ``step`` in scope)."""

from __future__ import annotations

import textwrap

_TEMPLATE = """
import os, signal, sys
from async_rl import tracking
from async_rl.train import main

at_step = int(os.environ["AT_STEP"])
original = tracking.RunLogger.log

def log(self, metrics, step):
    original(self, metrics, step)
    if step == at_step:
{action}

tracking.RunLogger.log = log
main(sys.argv[1:])
"""

#: SIGKILL of the driver (Ray's workers and replicas die with it)
KILL = "os.kill(os.getpid(), signal.SIGKILL)"
#: half of the next row written, as a kill in the middle of a write leaves it, then SIGKILL
TORN_WRITE_THEN_KILL = "self._file.write('{\"step\": %d, \"actor/' % (step + 1))\nself._file.flush()\n" + KILL
#: the signal named by $SIGNAL (as Ctrl-C or `kill` would send it), twice when $SIGNAL_TWICE is set
SIGNAL = ("os.kill(os.getpid(), getattr(signal, os.environ['SIGNAL']))\n"
          "if os.environ.get('SIGNAL_TWICE'):\n    os.kill(os.getpid(), getattr(signal, os.environ['SIGNAL']))")


def cli_after_step(action: str) -> str:
    """The ``python -c`` script that runs the CLI and ``action`` after step ``$AT_STEP`` is logged."""
    return _TEMPLATE.format(action=textwrap.indent(action, " " * 8))
