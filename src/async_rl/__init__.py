"""async_rl: asynchronous single-rollout actor-critic RL for LLM post-training, on verl.

Importing the package registers our advantage estimators (``grpo_group``, ``sao_gae``, ``li2sao_group``, ``sapo_turn``)
and policy losses (``ppo_clip``, ``dis``, ``dis_clip``, ``sapo_ar``) in verl's registries; verl also loads them itself through the
``verl.plugins`` entry point.

One exception: launched as the CLI (``python -m async_rl.train``), the package defers that registration (it imports
torch and verl, ~15 s) until the config has been validated, so a config error is reported in about a second;
``async_rl.train`` registers before it builds anything.
"""

import sys

__version__ = "0.1.0"


def _launched_as_cli() -> bool:
    """True in the process of ``python [options] -m async_rl.train ...`` (``sys.orig_argv``, Python 3.10+)."""
    argv = list(getattr(sys, "orig_argv", ()))
    return any(arg == "-m" and argv[i + 1:i + 2] == ["async_rl.train"] for i, arg in enumerate(argv))


if not _launched_as_cli():
    from async_rl import verl_plugin as _verl_plugin  # noqa: E402,F401  (registers on import)
