"""What every rollout server keeps the same way (the hf standalone server in ``replica.py``, the hf hybrid server
in ``hybrid.py``, the vLLM server in ``vllm_engine.py``): request counters, the broken state and its error, the
fields of ``ping`` and ``progress``, and ``abort_request``. Each server adds only how it generates.
"""

from __future__ import annotations

from typing import Any, Optional

from async_rl.rollout.base import GenerationOutput


class ReplicaBrokenError(RuntimeError):
    """The replica's engine failed; every later call fails with this (the pool treats it as a dead replica)."""


class ServerBookkeeping:
    """Counters, broken state and the shared verl server methods. ``describe`` names the server in errors
    (e.g. ``"hf replica 0 (pid 123)"``); ``extra_counters`` are the server's own counters."""

    def _init_bookkeeping(self, replica_rank: int, extra_counters: tuple[str, ...] = ()) -> None:
        self.replica_rank = int(replica_rank)
        self.counters = {key: 0 for key in ("requests", "finished", "aborted", "tokens", "weight_updates",
                                            "paused_requests", *extra_counters)}
        self.last_update_s = 0.0  # seconds the last weight update took
        self._broken: Optional[str] = None  # why the engine failed; None while healthy
        self._paused = False

    # ------------------------------------------------------------------ failure
    def describe(self) -> str:
        raise NotImplementedError

    def _broken_message(self) -> str:
        return f"{self.describe()}: {self._broken}"

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise ReplicaBrokenError(self._broken_message())

    # ------------------------------------------------------------------ bookkeeping
    def _count_delivered(self, output: GenerationOutput) -> None:
        self.counters["finished" if output.finish_reason != "aborted" else "aborted"] += 1
        self.counters["tokens"] += len(output.token_ids)

    def _ping_fields(self, pid: Optional[int], version: int, num_unfinished: int, device: Any,
                     stalled_s: float = 0.0) -> dict[str, Any]:
        """``ping``'s reply: health and progress (``stalled_s``: how long work has waited on a stuck engine)."""
        return {"pid": pid, "replica_rank": self.replica_rank, "version": int(version),
                "num_unfinished": int(num_unfinished), "paused": self._paused, "device": device,
                "counters": dict(self.counters), "last_update_s": self.last_update_s, "stalled_s": stalled_s}

    @staticmethod
    def _progress_entry(token_ids, logprobs, versions) -> dict[str, list]:
        """One unfinished request in ``progress``'s reply (while paused: exactly the prefix that resumes)."""
        return {"token_ids": list(token_ids), "logprobs": list(logprobs), "versions": list(versions)}

    # ------------------------------------------------------------------ verl server interface
    async def abort_requests(self, request_ids: list[Any]) -> dict[str, Any]:
        raise NotImplementedError

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        return await self.abort_requests([request_id])
