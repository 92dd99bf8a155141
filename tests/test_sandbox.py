"""Tests for the code sandboxes: LocalSandbox containment and the SandboxFusion HTTP client."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from async_rl.sandbox import LocalSandbox, SandboxFusionClient, SandboxResult, make_sandbox

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LocalSandbox is Linux-only")


@pytest.fixture(scope="module")
def sandbox():
    # A uid range of our own (other test runs here use the default 65000...), for the process checks.
    uid = 65100 + os.getpid() % 400
    return LocalSandbox(timeout_s=10, memory_limit_mb=1024, max_processes=32, sandbox_uid=uid, sandbox_gid=uid)


def processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real uid is ``uid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as handle:
                status = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue
        if int(status["Uid"].split()[0]) == uid and not status["State"].strip().startswith("Z"):
            found.append(int(entry))
    return found


def assert_group_gone(result: SandboxResult) -> None:
    with pytest.raises(ProcessLookupError):
        os.killpg(result.process_group, 0)


# ---------------------------------------------------------------------------------------------- LocalSandbox


def test_prints_output_and_cleans_workdir(sandbox):
    result = sandbox.run("import os\nprint('hello', 6 * 7)\nprint(os.getcwd())")
    assert result.ok and result.error_kind is None and result.exit_code == 0 and not result.timed_out
    lines = result.stdout.splitlines()
    assert lines[0] == "hello 42"
    assert not os.path.exists(lines[1]), "the private working directory must be removed after the run"
    assert_group_gone(result)


def test_stdin_is_passed(sandbox):
    assert sandbox.run("print(input()[::-1])", stdin="abc\n").stdout == "cba\n"


def test_runs_as_unprivileged_user(sandbox):
    if not sandbox.isolation.privileges_dropped:
        assert os.geteuid() != 0  # only possible when the caller is not root
        return
    result = sandbox.run(
        "import os\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
        "try:\n    os.setuid(0)\nexcept PermissionError:\n    print('cannot regain root')"
    )
    assert result.stdout.splitlines() == [f"{sandbox.slot_uids[0]} {sandbox.slot_gids[0]} []", "cannot regain root"]


def test_infinite_loop_times_out_and_leaves_no_process(sandbox):
    started = time.monotonic()
    result = sandbox.run("print('started', flush=True)\nwhile True:\n    pass", timeout_s=2)
    elapsed = time.monotonic() - started
    assert result.timed_out and result.error_kind == "timeout" and result.exit_code is None
    assert result.stdout == "started\n"  # output before the kill is kept (unbuffered child)
    assert elapsed < 2 + 1.5, f"returned after {elapsed:.2f} s for a 2 s timeout"
    assert_group_gone(result)


def test_memory_bomb_is_contained(sandbox):
    result = sandbox.run("blob = bytearray(10 * 1024 ** 3)\nprint('allocated 10 GB')")
    assert "allocated" not in result.stdout
    assert result.error_kind == "memory" or (result.error_kind == "runtime_error" and "MemoryError" in result.stderr)
    assert "MemoryError" in result.stderr
    assert sandbox.run("print('still fine')").stdout == "still fine\n"  # host and sandbox unharmed


@pytest.mark.slow
def test_fork_bomb_is_contained(sandbox):
    started = time.monotonic()
    result = sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=3)
    assert result.error_kind == "timeout" and time.monotonic() - started < 3 + 3
    assert_group_gone(result)
    if sandbox.isolation.privileges_dropped:
        assert processes_of_uid(sandbox.slot_uids[0]) == []


def test_process_limit_holds_for_root_caller(sandbox):
    if sandbox.isolation.process_limit is None:
        assert not sandbox.isolation.privileges_dropped  # only without root is there no NPROC cap
        return
    code = (
        "import os, time\ncount = 0\n"
        "try:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n"
        "        count += 1\nexcept OSError as error:\n    print(count, error.errno)"
    )
    result = sandbox.run(code, timeout_s=10)
    forked, errno = map(int, result.stdout.split())
    assert errno == 11  # EAGAIN: pids.max (or, without a pids cgroup, RLIMIT_NPROC) reached
    assert forked < sandbox.isolation.process_limit
    assert processes_of_uid(sandbox.slot_uids[0]) == []  # the sleeping children died with the run


def test_write_outside_workdir_fails(sandbox):
    protected = tempfile.mkdtemp(prefix="async_rl_test_protected_")
    os.chmod(protected, 0o777)  # even a world-writable host directory must stay out of reach
    try:
        target = os.path.join(protected, "pwned.txt")
        result = sandbox.run(
            f"open('inside.txt', 'w').write('ok')\nprint('inside ok')\nopen({target!r}, 'w').write('x')"
        )
        assert result.stdout == "inside ok\n"  # the working directory itself is writable
        assert result.error_kind == "runtime_error"
        assert "FileNotFoundError" in result.stderr  # the host's /tmp is not even there
        assert not os.path.exists(target)
        for system_dir in ("/usr", "/etc", "/"):  # what is shown is read-only
            probe = os.path.join(system_dir, "async_rl_probe")
            denied = sandbox.run(f"open({probe!r}, 'w')")
            assert denied.error_kind == "runtime_error" and not os.path.exists(probe)
            assert "Read-only file system" in denied.stderr or "PermissionError" in denied.stderr
    finally:
        os.rmdir(protected)


def test_tmp_is_private_to_the_run(sandbox):
    marker = os.path.join(tempfile.gettempdir(), f"async_rl_sandbox_escape_{os.getpid()}")
    from test_sandbox_attacks import own_mount_listing  # the way to an interpreter under /tmp, if any

    result = sandbox.run(f"open({marker!r}, 'w').write('x')\nimport os\nprint(sorted(os.listdir('/tmp')))")
    expected = sorted([os.path.basename(marker), *own_mount_listing(sandbox, "/tmp")])
    assert result.ok and result.stdout == f"{expected}\n"  # writable, but private
    assert not os.path.exists(marker)  # the host's /tmp never saw it
    listing = sandbox.run("import os\nprint(os.listdir('/tmp'), os.listdir('/dev/shm'))").stdout
    assert listing == f"{own_mount_listing(sandbox, '/tmp')} {own_mount_listing(sandbox, '/dev/shm')}\n"


def test_network_is_blocked_when_isolated(sandbox):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        result = sandbox.run(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')"
        )
        if sandbox.network_isolated:
            assert "connected" not in result.stdout and result.error_kind == "runtime_error"
            assert "OSError" in result.stderr or "ConnectionRefusedError" in result.stderr
            listener.settimeout(0.1)
            with pytest.raises(OSError):  # nothing ever reached the listener
                listener.accept()
        else:
            # No network namespace on this machine: the sandbox must say so, loudly.
            assert sandbox.isolation.network_isolated is False
            assert any("network" in warning.lower() for warning in sandbox.isolation.warnings)
    finally:
        listener.close()


def test_missing_module_is_runtime_error(sandbox):
    result = sandbox.run("import definitely_not_an_installed_module")
    assert result.error_kind == "runtime_error" and result.exit_code == 1
    assert "ModuleNotFoundError" in result.stderr


def test_output_is_capped():
    small = LocalSandbox(timeout_s=10, max_output_bytes=1000)
    result = small.run("import sys\nsys.stdout.write('a' * 200000 + 'END')")
    assert result.ok and result.stdout_truncated
    assert len(result.stdout) < 1100 and result.stdout.startswith("a") and result.stdout.endswith("END")
    assert "bytes truncated" in result.stdout


def test_max_concurrency_serialises_runs():
    serial = LocalSandbox(timeout_s=10, max_concurrency=1)
    code = "import time\ntime.sleep(0.6)"
    results: list[SandboxResult] = []
    started = time.monotonic()
    runners = [threading.Thread(target=lambda: results.append(serial.run(code))) for _ in range(2)]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join()
    assert [r.ok for r in results] == [True, True]
    assert time.monotonic() - started >= 1.2  # one after the other, not side by side


def test_async_run(sandbox):
    result = asyncio.run(sandbox.arun("print(sum(range(10)))"))
    assert result.stdout == "45\n"


# ---------------------------------------------------------------------------------------------- SandboxFusion client


class FakeFusionHandler(BaseHTTPRequestHandler):
    """Mimics SandboxFusion's POST /run_code closely enough for the client."""

    requests_seen: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server naming
        if self.path != "/run_code":
            self.send_error(404)
            return
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeFusionHandler.requests_seen.append(request)
        code = request["code"]
        if "crash_server" in code:
            self.send_error(500, "internal failure")
            return
        if "while True" in code:
            reply = {"status": "Failed", "message": "", "run_result": {"status": "TimeLimitExceeded",
                     "execution_time": request["run_timeout"], "return_code": None, "stdout": "", "stderr": ""}}
        elif "raise" in code:
            reply = {"status": "Failed", "message": "", "run_result": {"status": "Finished", "execution_time": 0.01,
                     "return_code": 1, "stdout": "", "stderr": "Traceback...\nValueError: nope\n"}}
        elif "sandbox_broken" in code:
            reply = {"status": "SandboxError", "message": "no executor available", "run_result": None}
        else:
            reply = {"status": "Success", "message": "", "compile_result": None, "run_result": {
                "status": "Finished", "execution_time": 0.01, "return_code": 0,
                "stdout": f"ran {len(code)} chars\n", "stderr": ""}}
        body = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # keep test output clean
        pass


@pytest.fixture(scope="module")
def fusion_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeFusionHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fusion_success_and_request_format(fusion_url):
    client = make_sandbox("fusion", url=fusion_url, timeout_s=7)
    assert isinstance(client, SandboxFusionClient)
    result = client.run("print('hi')", stdin="input")
    assert result.ok and result.stdout == "ran 11 chars\n" and result.exit_code == 0
    sent = FakeFusionHandler.requests_seen[-1]
    assert sent["language"] == "python" and sent["run_timeout"] == 7 and sent["code"] == "print('hi')"
    assert sent["stdin"] == "input"


def test_fusion_maps_failures(fusion_url):
    client = SandboxFusionClient(url=fusion_url)
    timeout = client.run("while True: pass", timeout_s=2)
    assert timeout.error_kind == "timeout" and timeout.timed_out
    error = client.run("raise ValueError('nope')")
    assert error.error_kind == "runtime_error" and error.exit_code == 1 and "ValueError" in error.stderr
    broken = client.run("sandbox_broken")
    assert broken.error_kind == "sandbox_error" and "no executor" in broken.detail and broken.sandbox_failed
    http_error = client.run("crash_server")
    assert http_error.error_kind == "sandbox_error" and "HTTP 500" in http_error.detail


def test_fusion_unreachable_server():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    closed_port = probe.getsockname()[1]
    probe.close()  # nothing listens here now
    result = SandboxFusionClient(url=f"http://127.0.0.1:{closed_port}", max_retries=1, retry_delay_s=0.05).run("print(1)")
    assert result.error_kind == "unreachable" and result.exit_code is None and result.sandbox_failed
    assert "cannot reach SandboxFusion" in result.detail


def test_make_sandbox_rejects_unknown_kind():
    with pytest.raises(ValueError, match="valid kinds: fusion, local"):
        make_sandbox("docker")


# ---------------------------------------------------------------------------------------------- setup errors


def test_missing_bubblewrap_names_the_fix(monkeypatch):
    from async_rl.sandbox import SandboxUnavailableError
    from async_rl.sandbox import local as local_module

    real_which = local_module.shutil.which
    monkeypatch.setattr(local_module, "_CAPABILITY_CACHE", {})
    monkeypatch.setattr(local_module.shutil, "which", lambda name, path=None: None if name == "bwrap" else real_which(name, path=path))
    with pytest.raises(SandboxUnavailableError, match=r"apt-get install bubblewrap"):
        LocalSandbox(timeout_s=5)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("memory_limit_mb", 0), ("max_processes", -1), ("max_concurrency", 0), ("tmpfs_size_mb", 1.5),
     ("sandbox_uid", 0), ("timeout_s", 0)],
)
def test_bad_settings_fail_with_the_setting_named(setting, value):
    with pytest.raises(ValueError, match=setting.split("_uid")[0]):
        LocalSandbox(**{setting: value})
