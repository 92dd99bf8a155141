"""WebShop over HTTP: a small JSON protocol, a standard-library server for the built-in simulator, a client.

Protocol: ``POST /reset`` ``{"session_id", "goal_index"}``, ``POST /step`` ``{"session_id", "action"}``,
``POST /close``, ``GET /health``; errors ``400`` / ``404`` / ``408`` / ``500`` with ``{"error": str}``. A
wrapper around the real WebShop text env implements the same protocol. :class:`WebShopClient` raises
:class:`WebShopServerError` on every error reply and connection failure, so a broken server aborts the
trajectory instead of scoring it. Server: :class:`WebShopHTTPServer` (``port=0``: a free port, in a
thread), or ``python -m async_rl.envs.webshop.server --port 3000`` (``--help`` for the options).

Details: docs/webshop.md (The HTTP protocol; Running a real WebShop server).
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Mapping

from async_rl.envs.webshop.catalog import (
    DEFAULT_NUM_GOALS,
    DEFAULT_NUM_PRODUCTS,
    DEFAULT_NUM_TEST_GOALS,
    DEFAULT_SEED,
)
from async_rl.envs.webshop.simulator import Shop, ShopReply, WebShopSimulator, get_shop

__all__ = ["WebShopClient", "WebShopHTTPServer", "WebShopServerError", "main"]

_MAX_BODY_BYTES = 1 << 20

# Connections the kernel queues for accept(). socketserver's default is 5, which dropped (reset) most of
# 200 simultaneous connections; Linux caps the value at net.core.somaxconn (4096 by default).
DEFAULT_BACKLOG = 1024

# Seconds a connection may take to deliver one whole request (request line, headers and body), and the
# longest a keep-alive connection may sit idle. A client of this protocol sends a few hundred bytes at
# once, so a connection still sending after this long is stalled or hostile and is dropped.
DEFAULT_READ_TIMEOUT_S = 10.0


class WebShopServerError(RuntimeError):
    """The WebShop server could not be reached or answered with an error. Not a policy failure."""


class _RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Session:
    def __init__(self, simulator: WebShopSimulator) -> None:
        self.simulator = simulator
        self.lock = threading.Lock()


class _ConnectionWatch:
    """Deadlines of the connections that are receiving a request; the serve loop drops late ones.

    A per-``recv`` socket timeout alone does not bound a request: a client that sends one byte every few
    seconds never trips it. So each connection's request must arrive in full by a deadline; once that
    passes, :meth:`drop_late` shuts the socket's read side, the handler's blocked read returns at once
    with what arrived, the handler answers (408 for a POST) and closes, and its thread ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float | None] = {}  # None: the request is being handled

    def expect_request(self, connection: socket.socket, within_s: float) -> None:
        with self._lock:
            self._deadlines[connection] = time.monotonic() + within_s

    def request_received(self, connection: socket.socket) -> None:
        with self._lock:
            if connection in self._deadlines:
                self._deadlines[connection] = None

    def forget(self, connection: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(connection, None)

    def is_late(self, connection: socket.socket) -> bool:
        with self._lock:
            deadline = self._deadlines.get(connection)
        return deadline is not None and time.monotonic() > deadline

    def __len__(self) -> int:
        with self._lock:
            return len(self._deadlines)

    def drop_late(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [conn for conn, deadline in self._deadlines.items() if deadline is not None and now > deadline]
        for connection in late:
            _shutdown_quietly(connection, socket.SHUT_RD)

    def drop_all(self) -> None:
        with self._lock:
            connections = list(self._deadlines)
        for connection in connections:
            _shutdown_quietly(connection, socket.SHUT_RDWR)


def _shutdown_quietly(connection: socket.socket, how: int) -> None:
    try:
        connection.shutdown(how)
    except OSError:
        pass  # already closed by the client or the handler


class _ThreadingServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a real listen backlog and late connections dropped by the serve loop."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, backlog: int, watch: _ConnectionWatch) -> None:
        self.request_queue_size = backlog  # read by server_activate()'s listen() inside __init__
        self.watch = watch
        super().__init__(address, handler)

    def service_actions(self) -> None:
        # serve_forever calls this at least every poll_interval (0.5 s): the deadlines' resolution.
        super().service_actions()
        self.watch.drop_late()


class WebShopHTTPServer:
    """Serves :class:`WebShopSimulator` sessions over the protocol above (a threading HTTP server).

    ``port=0`` picks a free port (read :attr:`url` after construction). ``start()`` serves in a daemon
    thread; ``serve_forever()`` in the caller's; ``close()`` stops, drops open connections and releases
    the socket. Sessions are kept in LRU order, at most ``max_sessions`` (the oldest is dropped).
    Requests on different sessions run concurrently (one thread per connection); requests on one session
    are serialised.

    Robustness: the listen ``backlog`` (default 1024) lets hundreds of clients connect at the same moment;
    every connection must deliver each whole request within ``read_timeout_s`` (default 10 s; also the
    keep-alive idle limit and the limit of each blocking socket call), else it is closed and its thread
    ends: a POST cut off in its headers or body is answered ``408`` first, a cut-off request line ``400``
    (the standard library's parser), an idle connection nothing. ``active_connections`` counts open
    connections.
    """

    def __init__(self, shop: Shop | None = None, host: str = "127.0.0.1", port: int = 0, *,
                 max_turns: int = 15, max_sessions: int = 10000, page_size: int = 10,
                 max_results: int = 50, backlog: int = DEFAULT_BACKLOG,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
        if isinstance(backlog, bool) or not isinstance(backlog, int) or backlog < 1:
            raise ValueError(f"backlog must be an integer >= 1, got {backlog!r}")
        if isinstance(read_timeout_s, bool) or not isinstance(read_timeout_s, (int, float)) \
                or not 0 < read_timeout_s < float("inf"):
            raise ValueError(f"read_timeout_s must be a finite number of seconds > 0, got {read_timeout_s!r}")
        self.shop = shop if shop is not None else get_shop()
        self.max_turns = int(max_turns)
        self.page_size = int(page_size)
        self.max_results = int(max_results)
        self.max_sessions = int(max_sessions)
        self.read_timeout_s = float(read_timeout_s)
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._watch = _ConnectionWatch()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = owner.read_timeout_s  # StreamRequestHandler: settimeout() on every connection

            def setup(self) -> None:
                super().setup()
                owner._watch.expect_request(self.connection, owner.read_timeout_s)

            def finish(self) -> None:
                owner._watch.forget(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass  # the client is gone; nothing left to flush

            def handle_one_request(self) -> None:
                # The deadline of this request starts now (for a keep-alive connection: the idle wait too).
                owner._watch.expect_request(self.connection, owner.read_timeout_s)
                try:
                    super().handle_one_request()
                except OSError:  # reset by the client, or a reply that could not be sent in time
                    self.close_connection = True

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
                pass  # quiet: one line per request would flood training logs

            def do_GET(self) -> None:  # noqa: N802 - stdlib name
                owner._watch.request_received(self.connection)
                if self.path.rstrip("/") == "/health":
                    self._reply(200, {"status": "ok", "backend": "simulator",
                                      "num_goals": len(owner.shop.catalog.goals)})
                else:
                    self._reply(404, {"error": f"unknown path {self.path!r}"})

            def do_POST(self) -> None:  # noqa: N802 - stdlib name
                try:
                    body = self._read_json()
                    owner._watch.request_received(self.connection)
                    route = self.path.rstrip("/")
                    if route == "/reset":
                        payload = owner._reset(body)
                    elif route == "/step":
                        payload = owner._step(body)
                    elif route == "/close":
                        payload = owner._close_session(body)
                    else:
                        raise _RequestError(404, f"unknown path {self.path!r}")
                    self._reply(200, payload)
                except _RequestError as exc:
                    if exc.status in (400, 408):
                        self.close_connection = True  # the rest of the stream cannot be trusted
                    self._reply(exc.status, {"error": str(exc)})
                except Exception as exc:  # noqa: BLE001 - report, keep serving
                    self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

            def _read_json(self) -> dict[str, Any]:
                if owner._watch.is_late(self.connection):  # the headers were cut off at the deadline
                    raise _RequestError(408, f"request not received within {owner.read_timeout_s:g} s")
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    raise _RequestError(400, "bad Content-Length") from None
                if length > _MAX_BODY_BYTES:
                    raise _RequestError(400, "request body too large")
                try:
                    raw = self.rfile.read(length) if length > 0 else b""
                except TimeoutError:
                    raw = None
                if raw is None or len(raw) < max(length, 0):
                    if raw is None or owner._watch.is_late(self.connection):
                        raise _RequestError(408, f"request body not received within {owner.read_timeout_s:g} s")
                    raise _RequestError(400, f"request body ended after {len(raw)} of {length} bytes")
                try:
                    body = json.loads(raw.decode("utf-8") or "{}")
                except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                    raise _RequestError(400, f"body is not JSON: {exc}") from None
                if not isinstance(body, dict):
                    raise _RequestError(400, "body must be a JSON object")
                return body

            def _reply(self, status: int, payload: Mapping[str, Any]) -> None:
                data = json.dumps(payload).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)

        self._httpd = _ThreadingServer((host, int(port)), Handler, backlog, self._watch)

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def active_connections(self) -> int:
        """Connections whose handler thread is still running."""
        return len(self._watch)

    def start(self) -> "WebShopHTTPServer":
        """Serve in a background daemon thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._httpd.serve_forever, name="webshop-server", daemon=True)
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        """Stop serving, drop open connections and close the listening socket. Safe to call more than once."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._watch.drop_all()
        self._httpd.server_close()

    def __enter__(self) -> "WebShopHTTPServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ handlers
    @staticmethod
    def _session_id(body: Mapping[str, Any]) -> str:
        session_id = body.get("session_id")
        if not isinstance(session_id, str) or not session_id:
            raise _RequestError(400, "'session_id' must be a non-empty string")
        return session_id

    def _reset(self, body: Mapping[str, Any]) -> dict[str, Any]:
        session_id = self._session_id(body)
        goal_index = body.get("goal_index")
        num_goals = len(self.shop.catalog.goals)
        if isinstance(goal_index, bool) or not isinstance(goal_index, int) or not 0 <= goal_index < num_goals:
            raise _RequestError(400, f"'goal_index' must be an integer in [0, {num_goals}), got {goal_index!r}")
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                session = _Session(WebShopSimulator(self.shop, max_turns=self.max_turns, page_size=self.page_size,
                                                    max_results=self.max_results))
            self._sessions[session_id] = session
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        with session.lock:
            return session.simulator.reset(goal_index).to_dict()

    def _step(self, body: Mapping[str, Any]) -> dict[str, Any]:
        session_id = self._session_id(body)
        action = body.get("action")
        if not isinstance(action, str):
            raise _RequestError(400, "'action' must be a string")
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                self._sessions.move_to_end(session_id)
        if session is None:
            raise _RequestError(404, f"unknown session {session_id!r}; POST /reset first")
        with session.lock:
            if session.simulator.done:
                raise _RequestError(400, f"episode of session {session_id!r} is over; POST /reset first")
            return session.simulator.step(action).to_dict()

    def _close_session(self, body: Mapping[str, Any]) -> dict[str, Any]:
        session_id = self._session_id(body)
        with self._lock:
            return {"closed": self._sessions.pop(session_id, None) is not None}


class WebShopClient:
    """Client of the protocol above (standard-library ``urllib``; proxies ignored unless
    ``use_env_proxy``). Every method raises :class:`WebShopServerError` on a connection failure, a
    timeout (``timeout_s`` per request), an error status or a malformed reply."""

    def __init__(self, base_url: str, timeout_s: float = 30.0, use_env_proxy: bool = False) -> None:
        if not base_url:
            raise ValueError("WebShopClient needs a base URL such as 'http://127.0.0.1:3000'")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        handlers = [] if use_env_proxy else [urllib.request.ProxyHandler({})]
        self._opener = urllib.request.build_opener(*handlers)

    def _request(self, method: str, path: str, payload: Mapping[str, Any] | None = None,
                 timeout_s: float | None = None) -> dict[str, Any]:
        url = self.base_url + path
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        request = urllib.request.Request(url, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(request, timeout=timeout_s or self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = ""
            try:
                detail = json.loads(exc.read().decode("utf-8")).get("error", "")
            except Exception:  # noqa: BLE001 - the status alone is enough
                pass
            raise WebShopServerError(f"WebShop server {url} answered HTTP {exc.code}: {detail or exc.reason}") from exc
        except (urllib.error.URLError, OSError) as exc:  # refused, unreachable, DNS, timeout
            reason = getattr(exc, "reason", exc)
            raise WebShopServerError(f"WebShop server {url} unreachable: {reason}") from exc
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WebShopServerError(f"WebShop server {url} sent a non-JSON reply: {raw[:200]!r}") from exc
        if not isinstance(body, dict):
            raise WebShopServerError(f"WebShop server {url} sent {type(body).__name__}, expected an object")
        return body

    def _reply(self, body: Mapping[str, Any], url_path: str) -> ShopReply:
        try:
            return ShopReply.from_dict(body)
        except (TypeError, ValueError) as exc:
            raise WebShopServerError(f"{self.base_url}{url_path}: {exc}") from exc

    def reset(self, session_id: str, goal_index: int) -> ShopReply:
        body = self._request("POST", "/reset", {"session_id": session_id, "goal_index": int(goal_index)})
        return self._reply(body, "/reset")

    def step(self, session_id: str, action: str) -> ShopReply:
        return self._reply(self._request("POST", "/step", {"session_id": session_id, "action": action}), "/step")

    def close_session(self, session_id: str, timeout_s: float | None = None) -> bool:
        """Ask the server to forget a session; True if it did. Raises like the other methods."""
        return bool(self._request("POST", "/close", {"session_id": session_id}, timeout_s).get("closed", False))

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health")


def main(argv: list[str] | None = None) -> None:
    """``python -m async_rl.envs.webshop.server``: serve the built-in simulator until interrupted."""
    parser = argparse.ArgumentParser(description="Serve the built-in WebShop simulator over HTTP/JSON.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--catalog-seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--num-products", type=int, default=DEFAULT_NUM_PRODUCTS)
    parser.add_argument("--num-goals", type=int, default=DEFAULT_NUM_GOALS)
    parser.add_argument("--num-test-goals", type=int, default=DEFAULT_NUM_TEST_GOALS)
    parser.add_argument("--max-turns", type=int, default=15)
    parser.add_argument("--backlog", type=int, default=DEFAULT_BACKLOG,
                        help="connections queued for accept (Linux caps it at net.core.somaxconn)")
    parser.add_argument("--read-timeout-s", type=float, default=DEFAULT_READ_TIMEOUT_S,
                        help="seconds a connection may take to send one whole request, or sit idle")
    args = parser.parse_args(argv)
    shop = get_shop(args.catalog_seed, args.num_products, args.num_goals, args.num_test_goals)
    try:
        server = WebShopHTTPServer(shop, args.host, args.port, max_turns=args.max_turns, backlog=args.backlog,
                                   read_timeout_s=args.read_timeout_s)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"WebShop simulator serving {len(shop.catalog.goals)} goals on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


if __name__ == "__main__":
    main()
