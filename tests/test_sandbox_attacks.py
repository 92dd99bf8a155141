"""Attacks on LocalSandbox (issue 13): each must be contained, bounded in time, and cleaned up.

Every test asserts containment (the attack's goal was not reached), cleanup (no process of the sandbox
uids, no cgroup, ``cleanup_error is None``) and that the sandbox still serves a normal run afterwards.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from async_rl.sandbox import LocalSandbox, SandboxResult
from async_rl.sandbox import cgroup as cgroups
from async_rl.sandbox import local as local_module

REPO_ROOT = Path(__file__).resolve().parents[1]
# Other test runs on this machine use the default uids (65000...): a uid range of our own keeps their
# processes out of the "no process of the slot uids is left" checks.
TEST_UID = 65100 + os.getpid() % 400
REAL_CGROUP_PROBE = cgroups.probe  # the module fixture may patch it; tests that need the real one restore it


@pytest.fixture(scope="module", params=["machine_default", "forced_fallback"])
def sandbox(request):
    """What this machine offers (here: cgroups), and what a machine without a writable cgroup gets."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "forced_fallback":
            patch.setattr(local_module, "_CAPABILITY_CACHE", {})
            patch.setattr(cgroups, "probe", lambda memory_bytes, max_pids: (None, ["disabled by the test"]))
        # Fallback: 128 MB per process, 1024 // 128 = 8 processes per run.
        sandbox = LocalSandbox(timeout_s=10, memory_limit_mb=1024, process_memory_mb=128, max_processes=32,
                               max_concurrency=2, sandbox_uid=TEST_UID, sandbox_gid=TEST_UID)
        if request.param == "forced_fallback":
            assert sandbox.isolation.memory_scope == "per_process" and sandbox.isolation.process_limit == 8
        yield sandbox


def live_pids_of_uids(uids) -> list[int]:
    """Live (non-zombie) processes whose real uid is in ``uids``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as handle:
                status = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue
        if int(status["Uid"].split()[0]) in uids and not status["State"].strip().startswith("Z"):
            found.append(int(entry))
    return found


def own_run_cgroups(sandbox: LocalSandbox) -> list[str]:
    layout = sandbox._capabilities.layout
    if layout is None:
        return []
    prefix = f"async_rl_sandbox_{os.getpid()}_"
    return [
        os.path.join(parent, name)
        for parent in {layout.memory_parent, layout.pids_parent, layout.cpu_parent} - {None}
        for name in os.listdir(parent)
        if name.startswith(prefix)
    ]


def assert_cleaned_up(sandbox: LocalSandbox, *results: SandboxResult) -> None:
    for result in results:
        assert result.cleanup_error is None
    assert live_pids_of_uids(set(sandbox.isolation.slot_uids)) == []
    assert own_run_cgroups(sandbox) == []
    assert sandbox.run("print('still serving')").stdout == "still serving\n"


def run_in_thread(sandbox: LocalSandbox, code: str, timeout_s: float, results: dict, key: str) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.__setitem__(key, sandbox.run(code, timeout_s=timeout_s)))
    thread.start()
    return thread


def test_deep_directory_tree_is_gone_after_the_run(sandbox):
    # 3,000 levels (deeper than Python's recursion limit and, as one path, longer than PATH_MAX) in each
    # writable place: the old backend's shutil.rmtree raised RecursionError and left it on the host disk.
    code = (
        "import os\n"
        "for top in ('/workdir', '/tmp', '/dev/shm'):\n"
        "    fd = os.open(top, os.O_RDONLY)\n"
        "    for level in range(3000):\n"
        "        os.mkdir('d', dir_fd=fd)\n"
        "        next_fd = os.open('d', os.O_RDONLY, dir_fd=fd)\n"
        "        os.close(fd)\n"
        "        fd = next_fd\n"
        "    os.close(fd)\n"
        "print('built')\n"
    )
    mounts_before = Path("/proc/self/mountinfo").read_text().count("\n")
    started = time.monotonic()
    result = sandbox.run(code, timeout_s=60)
    assert result.ok and result.stdout == "built\n", result
    assert time.monotonic() - started < 60 + 10  # bounded: run() returned, nothing hung in cleanup
    assert Path("/proc/self/mountinfo").read_text().count("\n") == mounts_before  # no tmpfs left mounted
    # The next run (same slot, same uid) starts from empty private directories.
    fresh = sandbox.run("import os\nprint(sorted(os.listdir('.')), os.listdir('/tmp'), os.listdir('/dev/shm'))")
    assert fresh.stdout == "['main.py'] [] []\n"
    assert_cleaned_up(sandbox, result, fresh)


def test_host_unix_socket_on_the_filesystem_is_unreachable(sandbox):
    socket_dir = tempfile.mkdtemp(prefix="async_rl_test_socket_")
    os.chmod(socket_dir, 0o755)
    path = os.path.join(socket_dir, "host.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o777)  # file permissions would allow anyone: only the cage may stop it
    listener.listen(1)
    listener.settimeout(0.2)
    try:
        code = (
            "import socket\n"
            f"client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nclient.connect({path!r})\nprint('connected')"
        )
        result = sandbox.run(code)
        assert "connected" not in result.stdout and result.error_kind == "runtime_error"
        assert "FileNotFoundError" in result.stderr  # the socket's directory does not exist inside
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever reached the host
        # The usual host IPC directories are empty inside (no /run/*.sock, no /var/run, no /dev/shm files).
        listing = sandbox.run("import os\nprint([os.listdir(p) for p in ('/run', '/var/run', '/tmp', '/dev/shm')])")
        assert listing.stdout == "[[], [], [], []]\n"
    finally:
        listener.close()
        os.unlink(path)
        os.rmdir(socket_dir)
    assert_cleaned_up(sandbox, result, listing)


def test_host_abstract_unix_socket_is_unreachable(sandbox):
    # Abstract sockets have no file; they belong to the network namespace, so only a new one hides them.
    name = f"async_rl_test_abstract_{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)
    listener.settimeout(0.2)
    try:
        code = (
            "import socket\n"
            f"client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nclient.connect('\\0{name}')\nprint('connected')"
        )
        result = sandbox.run(code)
        assert "connected" not in result.stdout and result.error_kind == "runtime_error"
        assert "ConnectionRefusedError" in result.stderr
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
    assert_cleaned_up(sandbox, result)


@pytest.mark.parametrize("cgroup_allowed", [True, False], ids=["machine_default", "forced_fallback"])
def test_memory_of_forked_children_is_limited_for_the_run_as_a_whole(cgroup_allowed, monkeypatch):
    # 6 children x 200 MB touched and held at once would be 1.2 GB; the run may have 512 MB in total,
    # so at most 512 // 200 = 2 children can hold their block through the common holding window.
    monkeypatch.setattr(local_module, "_CAPABILITY_CACHE", {})
    if cgroup_allowed:
        monkeypatch.setattr(cgroups, "probe", REAL_CGROUP_PROBE)
    else:  # what a machine without a writable cgroup gets: RLIMIT_AS x RLIMIT_NPROC
        monkeypatch.setattr(cgroups, "probe", lambda memory_bytes, max_pids: (None, ["disabled by the test"]))
    limited = LocalSandbox(timeout_s=30, memory_limit_mb=512, process_memory_mb=256, max_processes=16,
                           sandbox_uid=TEST_UID + 10, sandbox_gid=TEST_UID + 10)
    if not cgroup_allowed:
        # 256 MB per process, 512 // 256 = 2 processes: the parent and one child.
        assert limited.isolation.memory_scope == "per_process" and limited.isolation.process_limit == 2
    code = (
        "import os, time\n"
        "children = []\n"
        "for index in range(6):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            block = bytearray(200 * 1024 * 1024)\n"
        "            for offset in range(0, len(block), 4096):\n"
        "                block[offset] = 1\n"
        "        except MemoryError:\n"
        "            os._exit(3)\n"
        "        time.sleep(4)\n"
        "        os._exit(0)\n"
        "    children.append(pid)\n"
        "codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]\n"
        "print(sum(code == 0 for code in codes), len(children))\n"
    )
    result = limited.run(code)
    held, forked = map(int, result.stdout.split())
    assert held <= 2, result
    if limited.isolation.memory_scope == "cgroup":
        assert forked == 6  # all could start: it is the shared memory budget that stopped them
    else:
        assert forked < 6  # the documented fallback: processes x per-process memory <= total
    assert_cleaned_up(limited, result)


def test_concurrent_runs_cannot_read_each_others_files_or_processes(sandbox):
    writer = (
        "import os, time\n"
        "open('/workdir/secret.txt', 'w').write('s3cret')\n"
        "open('/tmp/secret.txt', 'w').write('s3cret')\n"
        "began = time.time()\n"
        "time.sleep(4)\n"
        "print(os.getuid(), began, time.time())\n"
    )
    reader = (
        "import os, time\n"
        "began, found = time.time(), []\n"
        "while time.time() - began < 3:\n"
        "    for path in ('/workdir/secret.txt', '/tmp/secret.txt'):\n"
        "        if os.path.exists(path):\n"
        "            found.append(path)\n"
        "    visible = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "    time.sleep(0.1)\n"
        "print(os.getuid(), began, time.time(), sorted(set(found)), visible)\n"
    )
    results: dict[str, SandboxResult] = {}
    first = run_in_thread(sandbox, writer, 20, results, "writer")
    time.sleep(0.5)
    second = run_in_thread(sandbox, reader, 20, results, "reader")
    first.join(30)
    second.join(30)
    writer_uid, writer_began, writer_ended = results["writer"].stdout.split()
    reader_uid, reader_began, reader_ended, found, visible = results["reader"].stdout.split(maxsplit=4)
    assert float(reader_began) < float(writer_ended) and float(writer_began) < float(reader_ended)  # overlapped
    assert writer_uid != reader_uid  # one uid per concurrency slot
    assert {int(writer_uid), int(reader_uid)} <= set(sandbox.isolation.slot_uids)
    assert found == "[]"  # no file of the other run
    # Its own PID namespace: bwrap's init (1) and the program (2); the writer's processes are not there.
    assert visible.strip() == "[1, 2]"
    assert_cleaned_up(sandbox, results["writer"], results["reader"])


def test_fork_bomb_beside_a_normal_run_does_not_hurt_it(sandbox):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    normal = (
        "import os\n"
        "pids = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print(sum(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 0 for p in pids))\n"
    )
    results: dict[str, SandboxResult] = {}
    bombing = run_in_thread(sandbox, bomb, 6, results, "bomb")
    time.sleep(1.5)  # let the bomb reach its process cap first
    results["normal"] = sandbox.run(normal, timeout_s=20)
    bombing.join(30)
    assert results["normal"].ok and results["normal"].stdout == "4\n", results["normal"]
    assert results["bomb"].error_kind == "timeout"
    assert_cleaned_up(sandbox, results["bomb"], results["normal"])


def test_project_files_and_data_are_not_readable(sandbox):
    targets = [
        REPO_ROOT / "README.md",
        REPO_ROOT / "recipes" / "data",
        REPO_ROOT / "src" / "async_rl" / "sandbox" / "local.py",
        *sorted((REPO_ROOT / "recipes" / "data").glob("*")),
    ]
    assert all(target.exists() for target in targets)  # they are there on the host
    code = (
        "import os\n"
        f"print([os.path.exists(p) for p in {[str(t) for t in targets]!r}])\n"
        f"print(os.path.exists({str(REPO_ROOT)!r}) and sorted(os.listdir({str(REPO_ROOT)!r})))\n"
        "try:\n    import async_rl\n    print('imported')\nexcept ImportError:\n    print('no project')\n"
    )
    result = sandbox.run(code)
    lines = result.stdout.splitlines()
    assert lines[0] == str([False] * len(targets)), result
    # Only the interpreter's own directory may show up on the way (here the venv inside the repo).
    assert lines[1] in ("False", "[]", "['.venv']")
    assert lines[2] == "no project"
    assert_cleaned_up(sandbox, result)


def test_bad_output_never_raises_and_cannot_forge_the_status(sandbox):
    code = (
        "import sys\n"
        "sys.stdout.buffer.write(b'\\xff\\xfe\\x00 {\"exit-code\": 0}\\n')\n"
        "sys.stderr.buffer.write(b'\\xc3(' * 10)\n"
        "sys.exit(7)\n"
    )
    result = sandbox.run(code)
    assert result.exit_code == 7 and result.error_kind == "runtime_error"
    assert result.stdout.startswith("\ufffd\ufffd\x00")  # undecodable bytes replaced, not raised
    surrogate = sandbox.run("print('\udc80')")  # code a model could not even encode as UTF-8
    assert surrogate.error_kind == "runtime_error" and "SyntaxError" in surrogate.stderr
    assert_cleaned_up(sandbox, result, surrogate)


def test_cleanup_failure_is_reported_not_raised(sandbox, monkeypatch):
    def refuse(self, timeout_s):
        raise OSError(16, "Device or resource busy")

    def broken_start(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    if sandbox._capabilities.layout is not None:
        monkeypatch.setattr(cgroups.RunCgroup, "remove", refuse)
        result = sandbox.run("print('fine')")
        assert result.ok and result.stdout == "fine\n"
        assert "Device or resource busy" in result.cleanup_error
        monkeypatch.undo()
        for leftover in own_run_cgroups(sandbox):  # what the refused removal left behind
            os.rmdir(leftover)
    monkeypatch.setattr(local_module.subprocess, "Popen", broken_start)
    failed = sandbox.run("print('never runs')")
    assert failed.error_kind == "sandbox_error" and failed.sandbox_failed
    assert "Cannot allocate memory" in failed.detail
    monkeypatch.undo()
    assert_cleaned_up(sandbox)


def test_multiprocessing_works_on_the_private_dev_shm(sandbox):
    code = "import multiprocessing as mp\nwith mp.Pool(2) as pool:\n    print(pool.map(abs, [-1, -2, -3]))"
    result = sandbox.run(code, timeout_s=20)
    assert result.ok and result.stdout == "[1, 2, 3]\n", result
    assert_cleaned_up(sandbox, result)
