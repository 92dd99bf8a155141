"""Code execution sandboxes with one result type.

* :class:`LocalSandbox` (``local``): contained child processes on this machine (bubblewrap: an empty
  root with only the interpreter, no network, own PIDs; a cgroup per run; one uid per concurrency slot).
  See ``async_rl/sandbox/local.py`` for exactly what is isolated how, ``cgroup.py`` for the cgroups.
* :class:`SandboxFusionClient` (``fusion``): HTTP client for a SandboxFusion server.

Both expose ``run(code, timeout_s=None, stdin=None) -> SandboxResult`` and ``await arun(...)``.
Build one from config with :func:`make_sandbox`.
"""

from __future__ import annotations

from typing import Any

from async_rl.sandbox.fusion import SandboxFusionClient
from async_rl.sandbox.local import (
    IsolationReport,
    LocalSandbox,
    SandboxResult,
    SandboxUnavailableError,
    detect_isolation,
)

__all__ = [
    "IsolationReport",
    "LocalSandbox",
    "SandboxFusionClient",
    "SandboxResult",
    "SandboxUnavailableError",
    "detect_isolation",
    "make_sandbox",
]

_SANDBOX_KINDS = {"local": LocalSandbox, "fusion": SandboxFusionClient}


def make_sandbox(kind: str = "local", **kwargs: Any) -> LocalSandbox | SandboxFusionClient:
    """Create a sandbox: ``kind="local"`` -> LocalSandbox(**kwargs), ``"fusion"`` -> SandboxFusionClient(**kwargs)."""
    try:
        factory = _SANDBOX_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown sandbox kind {kind!r}; valid kinds: {', '.join(sorted(_SANDBOX_KINDS))}") from None
    return factory(**kwargs)
