"""The driver's side of the rollout replicas: :class:`ReplicaPool`, shaped like an in-process engine.

:class:`ReplicaPool` implements the calls ``RolloutManager`` drives an engine with (``add_requests``, ``step``,
``abort``, ``update_weights``, ``has_unfinished``, ``policy_version``) over ``N`` verl rollout replicas
(``async_rl.rollout.replicas``), so schedulers, episodes and algorithms are the same code for the in-driver
engine and for ``hf``, ``vllm`` and ``sglang`` replicas. It streams finished requests, sends new episodes to the
least-loaded live replica (later turns stay there), runs in-flight weight updates (pause, load, resume; no token
regenerated) and drops dead or hung replicas (:class:`ReplicaFailure`). Also :func:`attach_checkpoint_manager`
(``rollout.weight_sync=checkpoint_manager``). Replicas are started by :func:`async_rl.rollout.launch.launch_replicas`.

Details: docs/rollout.md (7, "Streaming and balancing", "In-flight weight update", "Faults"; 9).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from async_rl.rollout.base import GenerationOutput, GenerationRequest, SamplingParams
from async_rl.rollout.checkpoint_engine import check_published_handle, in_process_handle, published_handle
from async_rl.rollout.servers.base import ReplicaBrokenError
from async_rl.rollout.settings import FAILURE_POLICIES
from async_rl.rollout.wire import ENGINE_ERROR, OWN_SERVER_ENGINES, sampling_to_server_dict, token_output_to_generation

logger = logging.getLogger(__name__)

_TURN_SUFFIX = re.compile(r"/turn\d+$")
_AFFINITY_CAPACITY = 100_000  # remembered episodes; the oldest are forgotten first


class ReplicaFailure(RuntimeError):
    """A rollout replica died or hung and the run cannot (or must not) go on without it."""


def remote_error_line(error: BaseException) -> str:
    """One line for an error message: a remote error's last line (the exception itself, after Ray's traceback),
    else the first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if len(lines) > 1 and isinstance(error, RayTaskError) else (lines[0] if lines else repr(error))


def episode_key(request_id: Hashable) -> Hashable:
    """``"p3/r1/turn2"`` -> ``"p3/r1"``: all turns of one episode share a replica."""
    return _TURN_SUFFIX.sub("", request_id) if isinstance(request_id, str) else request_id


@dataclass
class _Live:
    """One driver request while it is on a replica (across any number of pause/abort-resubmit rounds)."""

    request: GenerationRequest
    replica: int
    ref: Optional[ray.ObjectRef] = None
    server_request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    submissions: int = 0


class ReplicaPool:
    """``N`` rollout replicas behind the in-process engine interface (see the module docstring).

    Args:
        replicas: launched verl ``RolloutReplica`` s (``init_standalone`` done).
        engine: "hf" | "vllm" | "sglang" (decides the sampling dict and how weights are loaded).
        initial_version: policy version of the weights the replicas start with.
        poll_s: longest wait of one :meth:`step` for the first finished request.
        health_check_s: how often each replica is pinged.
        health_timeout_s: a replica that leaves a ping, a pause or a resume unanswered this long is hung.
        call_timeout_s: deadline of loading one weight version on every replica.
        on_replica_failure: "continue" (go on with the others) | "stop" (raise :class:`ReplicaFailure`).
        vocab_size: needed only to turn banned ids into SGLang allow-lists.
        tokenizer: decodes verl's plain ``TokenOutput`` replies (SGLang); our hf/vllm servers send their text.
        checkpoint_manager: verl's ``CheckpointEngineManager`` over the actor worker group and these replicas
            (``rollout.weight_sync=checkpoint_manager``): each update is then verl's own protocol (abort, release
            the KV cache, build the engine's topology, actor ranks send / replicas receive, finalize, resume),
            with the configured backend (NCCL on GPU, ``ray_object_store`` on CPU). None: the pool's own update.
    """

    accepts_published_weights = True  # the drivers may hand over ActorWorker.publish_weights handles

    def __init__(self, replicas: Sequence[Any], engine: str = "hf", *, initial_version: int = 0,
                 poll_s: float = 0.02, health_check_s: float = 2.0, health_timeout_s: float = 30.0,
                 call_timeout_s: float = 600.0, on_replica_failure: str = "continue",
                 vocab_size: Optional[int] = None, checkpoint_manager: Optional[Any] = None,
                 tokenizer: Optional[Any] = None) -> None:
        if not replicas:
            raise ValueError("ReplicaPool needs at least one launched replica (rollout.replicas >= 1)")
        if on_replica_failure not in FAILURE_POLICIES:
            raise ValueError(f"rollout.on_replica_failure={on_replica_failure!r}; valid choices: "
                             f"{', '.join(FAILURE_POLICIES)}")
        if min(poll_s, health_check_s, health_timeout_s, call_timeout_s) <= 0:
            raise ValueError("poll_s, health_check_s, health_timeout_s and call_timeout_s must be > 0")
        self.replicas = list(replicas)
        self.engine_name = engine
        self.poll_s = poll_s
        self.health_check_s = health_check_s
        self.health_timeout_s = health_timeout_s
        self.call_timeout_s = call_timeout_s
        self.on_replica_failure = on_replica_failure
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer  # decodes the text of verl's plain TokenOutput replies (SGLang)
        self._version = int(initial_version)
        self._lock = threading.RLock()
        self._live: dict[Hashable, _Live] = {}
        self._by_ref: dict[ray.ObjectRef, _Live] = {}
        self._outstanding = [0] * len(self.replicas)
        self._affinity: OrderedDict[Hashable, int] = OrderedDict()
        self.alive = [True] * len(self.replicas)
        self.failures: list[dict[str, Any]] = []
        self._failed_outputs: list[GenerationOutput] = []  # aborted by a failure, returned by the next step()
        self._pings: dict[int, tuple[ray.ObjectRef, float]] = {}
        self._last_ping = [time.monotonic()] * len(self.replicas)
        self.counters = {"submitted": 0, "resubmitted": 0, "finished": 0, "replica_aborted": 0,
                         "driver_aborted": 0, "engine_errors": 0, "wasted_tokens": 0, "weight_updates": 0}
        self.update_latencies_s: list[float] = []
        self.max_positions: Optional[int] = None  # the model's context, read by the builder (Episode limits)
        # rollout.mode=hybrid: every replica runs inside a train rank and reads the actor's weights in memory, so a
        # publication moves no weights (PublicationForm.VERSION_ONLY, rollout/publication.py: only the version)
        self.weights_in_process = all(getattr(r, "rollout_mode", None) is not None and
                                      getattr(r.rollout_mode, "value", None) == "hybrid" for r in self.replicas)
        self.checkpoint_manager = checkpoint_manager
        if checkpoint_manager is not None and self.weights_in_process:
            raise ValueError("hybrid replicas sync in memory; a checkpoint manager has nothing to move "
                             "(rollout.weight_sync=pool with rollout.mode=hybrid)")
        self.pids = self._ask_pids()

    @property
    def takes_version_only(self) -> bool:
        """True when the pool gets the weights itself -- hybrid replicas from their train rank's memory, verl's
        checkpoint manager from the actor ranks -- so a publication hands over only the version."""
        return self.weights_in_process or self.checkpoint_manager is not None

    # ------------------------------------------------------------------ the engine interface
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live) or bool(self._failed_outputs)

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._live)

    def add_requests(self, requests: Iterable[GenerationRequest]) -> None:
        """Submit every request now (each to its episode's replica, or the least loaded live one)."""
        with self._lock:
            for request in requests:
                if request.request_id in self._live:
                    raise ValueError(f"duplicate request_id {request.request_id!r}: it is still running")
                live = _Live(request=request, replica=self._choose_replica(request.request_id))
                self._live[request.request_id] = live
                self._outstanding[live.replica] += 1
                self._submit(live)
                self.counters["submitted"] += 1

    def start(self, requests: Iterable[GenerationRequest]) -> None:
        self.add_requests(requests)

    def step(self, max_tokens: Optional[int] = None) -> list[GenerationOutput]:
        """Requests that finished since the last call (waits at most ``poll_s`` for the first)."""
        with self._lock:
            outputs, self._failed_outputs = self._failed_outputs, []
            refs = list(self._by_ref)
        if refs and not outputs:
            ready, _ = ray.wait(refs, num_returns=1, timeout=self.poll_s)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        elif refs:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        else:
            ready = []
        for ref in ready:
            outputs += self._collect(ref)
        outputs += self._check_health()
        return outputs

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Run ``requests`` to completion; outputs in request order (for evaluation and tests)."""
        requests = list(requests)
        self.add_requests(requests)
        wanted = {r.request_id for r in requests}
        done: dict[Hashable, GenerationOutput] = {}
        while len(done) < len(wanted):
            for output in self.step():
                if output.request_id in wanted:
                    done[output.request_id] = output
        return [done[r.request_id] for r in requests]

    def abort(self, request_ids: Optional[Iterable[Hashable]] = None) -> list[GenerationOutput]:
        """End these requests (all if None) as "aborted" now; their replicas stop computing them.

        Returns their outputs with the tokens known so far; they are never returned by :meth:`step`.
        """
        with self._lock:
            ids = list(self._live) if request_ids is None else [r for r in request_ids if r in self._live]
            per_replica: dict[int, list[str]] = {}
            outputs = []
            for rid in ids:
                live = self._drop(rid)
                per_replica.setdefault(live.replica, []).append(live.server_request_id)
                self.counters["driver_aborted"] += 1
                self.counters["wasted_tokens"] += len(live.token_ids)
                outputs.append(self._output(live, "aborted"))
        for index, server_ids in per_replica.items():
            if self.alive[index]:
                self._server(index).abort_requests.remote(server_ids)  # fire and forget: the reply is ignored
        return outputs

    def update_weights(self, weights: Mapping[str, torch.Tensor] | dict[str, Any], version: int) -> None:
        """Pause every replica, load ``weights`` as ``version``, resume.

        ``weights`` is what :func:`async_rl.rollout.publication.weights_to_publish` gives under the run's
        strategy: a version-only handle when the pool gets the weights itself (:attr:`takes_version_only`), a
        published handle, or a state dict (put in the object store here, once for every replica). Requests keep
        their tokens; tokens sampled from now on carry ``version``.
        """
        version_only = weights is None or (isinstance(weights, Mapping) and weights.get("in_process") is True)
        if version_only != self.takes_version_only:
            want = ("only the version (None or in_process_handle(version)): its replicas get the weights themselves"
                    if self.takes_version_only else "a published handle or a state dict: its replicas load what "
                    "they are sent")
            raise ValueError(f"update_weights(version={version}): this pool takes {want} (the strategy is "
                             f"async_rl.rollout.publication.choose_publication_form(actor, pool))")
        if self.checkpoint_manager is not None:  # verl's manager pulls from the actor ranks
            started = time.perf_counter()
            self._update_through_manager(int(version))
            self.counters["weight_updates"] += 1
            self.update_latencies_s.append(time.perf_counter() - started)
            return
        if self.weights_in_process:
            published = in_process_handle(version)
        elif "ref" in weights and "version" in weights:
            published = dict(weights)
        else:
            items = weights.items() if isinstance(weights, Mapping) else weights
            published = published_handle(version, ray.put({k: v.detach().cpu().contiguous() for k, v in items}))
        if not self.weights_in_process:
            check_published_handle(published, version)
        started = time.perf_counter()
        if self.engine_name in OWN_SERVER_ENGINES:
            # a pause or a resume takes at most one decode chunk: a replica slower than a ping is hung
            paused = self._on_every_replica("abort_all_requests", (), "pause", timeout_s=self.health_timeout_s)
            try:
                self._on_every_replica("update_weights", (published, int(version)), "weight update", only=paused,
                                       timeout_s=self.call_timeout_s)
                self._version = int(version)
            finally:
                self._on_every_replica("resume_generation", (), "resume", only=paused,
                                       timeout_s=self.health_timeout_s)
        else:
            self._update_verl_replicas(published, int(version))
        self.counters["weight_updates"] += 1
        self.update_latencies_s.append(time.perf_counter() - started)

    def export_inflight(self) -> list[dict]:
        """Live requests for a checkpoint, each with its **kept prefix**: the tokens (log-probs, versions)
        the driver already holds. Replay rule on resume (:meth:`import_inflight`): every request is
        resubmitted as ``prompt + kept prefix`` with the remaining budget. Tokens a replica sampled but has
        not returned yet live in another process and are not saved; they are sampled again after the
        resume (the hf server returns a turn only when it is done, so its kept prefix is usually empty;
        a vLLM/SGLang request resubmitted after a weight update keeps what it had). Nothing trained is lost:
        no token reaches the trainer before its request finishes. Read-only: the running requests go on."""
        with self._lock:
            return [{"request_id": live.request.request_id, "prompt_ids": list(live.request.prompt_ids),
                     "sampling": dict(vars(live.request.sampling)), "token_ids": list(live.token_ids),
                     "logprobs": list(live.logprobs), "versions": list(live.versions)}
                    for live in self._live.values()]

    def import_inflight(self, states: list[dict]) -> None:
        """Resubmit the requests of :meth:`export_inflight` (or of the in-driver engine's checkpoint: its
        random-stream keys are not used) with their kept prefixes; the pool must have none running."""
        with self._lock:
            if self._live:
                raise RuntimeError(f"import_inflight() needs an idle pool; {len(self._live)} request(s) are live")
            for state in states:
                request = GenerationRequest(state["request_id"], list(state["prompt_ids"]),
                                            SamplingParams(**state["sampling"]))
                live = _Live(request=request, replica=self._choose_replica(request.request_id),
                             token_ids=list(state["token_ids"]), logprobs=list(state["logprobs"]),
                             versions=list(state["versions"]))
                self._live[request.request_id] = live
                self._outstanding[live.replica] += 1
                self._submit(live)
                self.counters["resubmitted"] += 1

    def metrics(self) -> dict[str, float]:
        latencies = self.update_latencies_s
        return {
            "rollout/replicas_alive": float(sum(self.alive)),
            "rollout/resubmitted": float(self.counters["resubmitted"]),
            "rollout/update_latency_s": latencies[-1] if latencies else 0.0,
            "rollout/outstanding": float(sum(self._outstanding)),
            "async/replica_aborted": float(self.counters["replica_aborted"]),
            "rollout/engine_errors": float(self.counters["engine_errors"]),
            "async/wasted_tokens": float(self.counters["wasted_tokens"]),
        }

    def shutdown(self) -> None:
        for replica in self.replicas:
            for server in getattr(replica, "servers", []):
                try:
                    ray.kill(server, no_restart=True)
                except Exception:  # already gone
                    pass

    # ------------------------------------------------------------------ internals
    def _server(self, index: int):
        return self.replicas[index].servers[0]

    def _ping(self, index: int) -> ray.ObjectRef:
        """A health probe: the hf servers' ``ping`` (with the decode loop's stall time); verl's vLLM/SGLang servers
        have no ping, so any actor call answers for their liveness."""
        server = self._server(index)
        if self.engine_name in OWN_SERVER_ENGINES:
            return server.ping.remote()
        return server.__ray_call__.remote(lambda actor: {"pid": __import__("os").getpid(), "stalled_s": 0.0})

    def _ask_pids(self) -> list[Optional[int]]:
        pids: list[Optional[int]] = []
        for index in range(len(self.replicas)):
            server = self._server(index)
            try:  # the hf servers say where their engine runs (a train rank's process in hybrid mode)
                ref = server.get_pid.remote() if self.engine_name in OWN_SERVER_ENGINES else \
                    server.__ray_call__.remote(lambda actor: __import__("os").getpid())
                pids.append(int(ray.get(ref, timeout=self.health_timeout_s)))
            except Exception:  # a replica that does not answer is caught by the health check
                pids.append(None)
        return pids

    def _choose_replica(self, request_id: Hashable) -> int:
        key = episode_key(request_id)
        index = self._affinity.get(key)
        if index is not None and self.alive[index]:
            self._affinity.move_to_end(key)
            return index
        candidates = [i for i, ok in enumerate(self.alive) if ok]
        if not candidates:
            raise ReplicaFailure(self._failure_message("no rollout replica is alive"))
        index = min(candidates, key=lambda i: (self._outstanding[i], i))
        self._affinity[key] = index
        if len(self._affinity) > _AFFINITY_CAPACITY:
            self._affinity.popitem(last=False)
        return index

    def _submit(self, live: _Live) -> None:
        request = live.request
        remaining = request.sampling.max_new_tokens - len(live.token_ids)
        sampling = SamplingParams(**{**vars(request.sampling), "max_new_tokens": max(1, remaining)})
        live.submissions += 1
        live.server_request_id = f"{request.request_id}" if live.submissions == 1 else \
            f"{request.request_id}#{live.submissions}"
        live.ref = self._server(live.replica).generate.remote(
            prompt_ids=list(request.prompt_ids) + live.token_ids,
            sampling_params=sampling_to_server_dict(
                sampling, "hf" if self.engine_name in OWN_SERVER_ENGINES else self.engine_name, self.vocab_size),
            request_id=live.server_request_id)
        self._by_ref[live.ref] = live

    def _drop(self, request_id: Hashable) -> _Live:
        live = self._live.pop(request_id)
        self._by_ref.pop(live.ref, None)
        self._outstanding[live.replica] -= 1
        return live

    def _output(self, live: _Live, finish_reason: str, text: str = "", stop_reason=None) -> GenerationOutput:
        return GenerationOutput(request_id=live.request.request_id, prompt_ids=list(live.request.prompt_ids),
                                token_ids=list(live.token_ids), logprobs=list(live.logprobs),
                                versions=list(live.versions), finish_reason=finish_reason, text=text,
                                stop_reason=stop_reason)

    def _collect(self, ref: ray.ObjectRef) -> list[GenerationOutput]:
        with self._lock:
            live = self._by_ref.get(ref)
        if live is None:
            return []  # aborted by the driver meanwhile
        try:
            reply = ray.get(ref)
        except (RayActorError, ReplicaBrokenError) as error:  # died, or its decode loop failed
            return self._replica_failed(live.replica, f"{type(error).__name__}: {remote_error_line(error)}")
        except RayTaskError as error:
            raise RuntimeError(f"rollout replica {live.replica} (pid {self.pids[live.replica]}) failed request "
                               f"{live.request.request_id!r}: {error}") from error
        with self._lock:
            if self._by_ref.get(ref) is not live:
                return []  # aborted or failed while we were reading
            piece = token_output_to_generation(live.request, reply, self._version, self.tokenizer)
            live.token_ids += piece.token_ids
            live.logprobs += piece.logprobs
            live.versions += piece.versions
            self._by_ref.pop(ref, None)
            budget_left = live.request.sampling.max_new_tokens - len(live.token_ids)
            if piece.finish_reason == "aborted" and piece.stop_reason == ENGINE_ERROR:
                # the engine failed this request (vLLM "error"): an engine fault, not a pause; never resubmitted
                self._drop(live.request.request_id)
                self.counters["engine_errors"] += 1
                self.counters["wasted_tokens"] += len(live.token_ids)
                logger.warning("rollout replica %d failed request %r (engine error); its trajectory is aborted",
                               live.replica, live.request.request_id)
                return [self._output(live, "aborted", piece.text, ENGINE_ERROR)]
            if piece.finish_reason == "aborted" and self.alive[live.replica] and budget_left > 0:
                # the server dropped it for a weight update (vLLM/SGLang): continue from the prefix
                self.counters["resubmitted"] += 1
                self._submit(live)
                return []
            finish = "length" if piece.finish_reason == "aborted" and budget_left <= 0 else piece.finish_reason
            self._drop(live.request.request_id)
            self.counters["finished"] += 1
            return [self._output(live, finish, piece.text, piece.stop_reason)]

    def _on_every_replica(self, method: str, args: tuple, what: str, only: Optional[list[int]] = None,
                          timeout_s: Optional[float] = None) -> list[int]:
        """Call ``method`` on every live replica (or ``only``) and wait; a replica that raises ``RayActorError``
        or misses ``timeout_s`` (default ``call_timeout_s``) is failed. Returns the replicas that answered."""
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        indices = [i for i in (range(len(self.replicas)) if only is None else only) if self.alive[i]]
        refs = {getattr(self._server(i), method).remote(*args): i for i in indices}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        answered = []
        for ref in pending:
            self._queue_failure(refs[ref], f"no answer to the {what} within {timeout_s:g} s (hung)")
        for ref in ready:
            index = refs[ref]
            try:
                ray.get(ref)
                answered.append(index)
            except RayActorError as error:
                self._queue_failure(index, f"{type(error).__name__} during {what}: {error}")
            except RayTaskError as error:
                raise RuntimeError(f"rollout replica {index} (pid {self.pids[index]}) failed the {what}: "
                                   f"{error}") from error
        return sorted(answered)

    def _update_verl_replicas(self, published: dict[str, Any], version: int) -> None:
        """vLLM / SGLang replicas, through verl's own pieces: ``RolloutReplica.abort_all_requests`` (their
        servers return partial outputs, which :meth:`_collect` resubmits with the prefix), then each replica's
        ``CheckpointEngineWorker`` receives the weights from our object-store checkpoint engine
        (``rollout.checkpoint_engine.backend=ray_object_store``) and pushes them into the inference engine
        through verl's server adapter (CUDA IPC / shared memory; it also clears the prefix cache and sets
        ``global_steps``), then ``RolloutReplica.resume_generation``. On GPU only: not run on this machine."""
        alive = [i for i, ok in enumerate(self.alive) if ok]

        async def phase(coroutines) -> None:
            await asyncio.wait_for(asyncio.gather(*coroutines), timeout=self.call_timeout_s)

        asyncio.run(phase([self.replicas[i].abort_all_requests() for i in alive]))
        try:
            workers = [w for i in alive for w in self.replicas[i].workers]
            ray.get([w.execute_checkpoint_engine.remote("set_source", published) for w in workers],
                    timeout=self.call_timeout_s)
            ray.get([w.update_weights.remote(global_steps=version) for w in workers], timeout=self.call_timeout_s)
            self._version = version
        finally:
            asyncio.run(phase([self.replicas[i].resume_generation() for i in alive]))

    def _update_through_manager(self, version: int) -> None:
        """One update by verl's ``CheckpointEngineManager`` over the live replicas, under a deadline. If it fails or
        hangs, every live replica is pinged: those that do not answer within ``health_timeout_s`` are failed (and
        killed, which also unblocks the manager's pending calls) and the update is retried once without them."""
        last_error: Optional[str] = None
        for _ in range(2):
            live = [i for i, ok in enumerate(self.alive) if ok]
            self.checkpoint_manager.replicas = [self.replicas[i] for i in live]
            last_error = _run_with_deadline(lambda: self.checkpoint_manager.update_weights(global_steps=version),
                                            self.call_timeout_s)
            if last_error is None:
                self._version = version
                return
            failed = self._probe_replicas(live)
            if not failed:
                break  # every replica answers: the failure is not theirs (e.g. the actor ranks)
        raise RuntimeError(f"verl's checkpoint manager failed to move version {version} to the replicas: {last_error}")

    def _probe_replicas(self, indices: list[int]) -> list[int]:
        """Ping these replicas; fail those that do not answer within ``health_timeout_s``. Returns the failed."""
        refs = {self._ping(i): i for i in indices}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=self.health_timeout_s)
        failed = [refs[ref] for ref in pending]
        for ref in ready:
            try:
                ray.get(ref)
            except (RayActorError, RayTaskError):
                failed.append(refs[ref])
        for index in sorted(failed):
            self._queue_failure(index, "no answer to a ping after a failed weight update (dead or hung)")
        return failed

    def _check_health(self) -> list[GenerationOutput]:
        now = time.monotonic()
        outputs: list[GenerationOutput] = []
        for index in range(len(self.replicas)):
            if not self.alive[index]:
                continue
            if index in self._pings:
                ref, sent = self._pings[index]
                done, _ = ray.wait([ref], timeout=0)
                if done:
                    del self._pings[index]
                    try:
                        health = ray.get(ref)
                    except (RayActorError, RayTaskError) as error:
                        outputs += self._replica_failed(index, f"{type(error).__name__}: {remote_error_line(error)}")
                        continue
                    stalled = float(health.get("stalled_s", 0.0)) if isinstance(health, Mapping) else 0.0
                    if stalled > self.health_timeout_s:  # the process answers, its engine does not move
                        outputs += self._replica_failed(index, f"its decode loop made no progress for {stalled:.0f} s "
                                                               f"(hung)")
                elif now - sent > self.health_timeout_s:
                    del self._pings[index]
                    outputs += self._replica_failed(index, f"no answer to a ping within {self.health_timeout_s:g} s "
                                                           f"(hung)")
            elif now - self._last_ping[index] >= self.health_check_s:
                self._pings[index] = (self._ping(index), now)
                self._last_ping[index] = now
        return outputs

    def _queue_failure(self, index: int, reason: str) -> None:
        outputs = self._replica_failed(index, reason)
        with self._lock:
            self._failed_outputs += outputs

    def _replica_failed(self, index: int, reason: str) -> list[GenerationOutput]:
        """Mark replica ``index`` dead, end its live requests as aborted; raise if the run cannot go on."""
        with self._lock:
            if not self.alive[index]:
                return []
            self.alive[index] = False
            lost = [rid for rid, live in self._live.items() if live.replica == index]
            outputs = []
            for rid in lost:
                live = self._drop(rid)
                self.counters["replica_aborted"] += 1
                self.counters["wasted_tokens"] += len(live.token_ids)
                outputs.append(self._output(live, "aborted"))
            self.failures.append({"replica": index, "pid": self.pids[index], "reason": reason,
                                  "aborted_requests": len(lost)})
            for key in [k for k, i in self._affinity.items() if i == index]:
                del self._affinity[key]
        logger.warning("rollout replica %d (pid %s) failed: %s; %d live requests aborted", index,
                       self.pids[index], reason, len(lost))
        try:
            ray.kill(self._server(index), no_restart=True)  # a hung replica must not come back half-way
        except Exception:
            pass
        if self.on_replica_failure == "stop" or not any(self.alive):
            raise ReplicaFailure(self._failure_message(f"rollout replica {index} (pid {self.pids[index]}) failed: "
                                                       f"{reason}"))
        return outputs

    def _failure_message(self, head: str) -> str:
        alive = [i for i, ok in enumerate(self.alive) if ok]
        return (f"{head}; {len(self.failures)} replica failure(s), live replicas: {alive or 'none'}, requests "
                f"aborted by failures: {self.counters['replica_aborted']}. Set rollout.on_replica_failure=continue "
                f"to go on with the remaining replicas, or restart the run.")


def _run_with_deadline(call, timeout_s: float) -> Optional[str]:
    """Run ``call`` in a daemon thread; None if it returned in time, else what went wrong (one line)."""
    outcome: dict[str, BaseException] = {}

    def target() -> None:
        try:
            call()
        except BaseException as error:  # reported to the caller
            outcome["error"] = error

    thread = threading.Thread(target=target, name="async_rl-weight-sync", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return f"no answer within {timeout_s:g} s (hung)"
    error = outcome.get("error")
    return None if error is None else f"{type(error).__name__}: {remote_error_line(error)}"


def attach_checkpoint_manager(pool: ReplicaPool, actor_group: Any, backend: str = "ray_object_store",
                              bucket_megabytes: int = 2048) -> Any:
    """Give ``pool`` verl's ``CheckpointEngineManager`` over ``actor_group`` (an ActorWorker/SapoWorker worker group)
    and its replicas (``rollout.weight_sync=checkpoint_manager``); returns the manager.

    Every actor rank gets a ``backend`` sender (``ActorWorker.init_checkpoint_engine``); the replicas' receivers were
    made with the same backend by :func:`launch_replicas` (``checkpoint_backend=``)."""
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.workers.config import CheckpointEngineConfig

    from async_rl.rollout.checkpoint_engine import BACKEND_NAME, ObjectStoreCheckpointEngine

    if pool.weights_in_process:
        raise ValueError("hybrid replicas sync in memory; a checkpoint manager has nothing to move")
    module = "async_rl.rollout.checkpoint_engine"
    actor_group.init_checkpoint_engine(backend, int(bucket_megabytes), None, module)
    config = CheckpointEngineConfig(backend=backend, update_weights_bucket_megabytes=int(bucket_megabytes),
                                    custom_backend_module=module)
    manager = CheckpointEngineManager(config, actor_group, list(pool.replicas))
    if backend == BACKEND_NAME:
        ObjectStoreCheckpointEngine.build_topology(0, 0, [])  # start the mailbox actor now, not in the first update
    pool.checkpoint_manager = manager
    return manager


__all__ = ["ReplicaFailure", "ReplicaPool", "attach_checkpoint_manager", "episode_key", "remote_error_line"]
