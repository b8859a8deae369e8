"""``kvtier node serve``'s --pool and --socket paths (docs/node.md § Running it): only a kvtier pool
and a stale socket are ever replaced; anything else there is refused in one sentence and kept."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvtier.core.tiers.node.pool import MAGIC
from kvtier.launch.localserver import stop_process
from tests.node_servers import SRC, NodeServer

DOCS = Path(__file__).resolve().parents[2] / "docs" / "node.md"


@pytest.fixture
def shm_pool():
    """A pool path in /dev/shm no other test uses; it and its lock file removed afterwards."""
    path = Path(f"/dev/shm/kvtier-test-paths-{uuid.uuid4().hex[:10]}")
    yield path
    for leftover in (path, path.with_name(path.name + ".lock")):
        if leftover.is_symlink() or leftover.exists():
            leftover.unlink()


def serve(pool: Path, socket: Path) -> subprocess.CompletedProcess[str]:
    """The real CLI in a process of its own (one that serves instead of refusing times out: a failure)."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "node", "serve", "--pool", str(pool),
                           "--node-gib", "0.0625", "--socket", str(socket), "--page-kib", "4"],
                          capture_output=True, text=True, check=False, timeout=60, env=env)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output and len(output.strip().splitlines()) == 1, output
    return output.strip()


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
def test_a_socket_path_that_is_not_a_socket_is_refused_and_kept(kind, shm_pool, tmp_path):
    """A file, a directory or a symbolic link at --socket was unlinked (a file: replaced by the
    socket; a directory: a traceback) by the fresh-user tester; now one sentence, and it stays."""
    target = tmp_path / "s"
    if kind == "file":
        target.write_text("important\n")
    elif kind == "directory":
        target.mkdir()
        (target / "inside").write_text("kept\n")
    else:
        (tmp_path / "elsewhere").write_text("kept\n")
        target.symlink_to(tmp_path / "elsewhere")
    words = {"file": "not a socket", "directory": "a directory", "symlink": "a symbolic link"}[kind]
    line = one_error_line(serve(shm_pool, target))
    assert line == (f"error: --socket {target} exists and is {words}; remove it yourself or give another --socket "
                    "path.")
    if kind == "file":
        assert target.read_text() == "important\n"
    elif kind == "directory":
        assert (target / "inside").read_text() == "kept\n"
    else:
        assert target.is_symlink() and target.read_text() == "kept\n"
    # a refused start leaves nothing it created: no pool, no lock file
    assert not shm_pool.exists() and not shm_pool.with_name(shm_pool.name + ".lock").exists()


@pytest.mark.parametrize("content", [b"data\n", b"", b"x" * 8192])
def test_a_pool_path_holding_another_file_is_refused_never_overwritten(content, shm_pool, tmp_path):
    """A file that does not start with a kvtier pool header (short, empty or pool-sized) was
    "created anew" over; now refused in one sentence naming what to do, the file byte for byte kept."""
    shm_pool.write_bytes(content)
    line = one_error_line(serve(shm_pool, tmp_path / "s.sock"))
    assert line == (f"error: --pool {shm_pool} exists and is not a kvtier node pool (it does not start with a kvtier "
                    "pool header); kvtier never overwrites it: remove it yourself or give another --pool path.")
    assert shm_pool.read_bytes() == content
    assert not (tmp_path / "s.sock").exists() and not shm_pool.with_name(shm_pool.name + ".lock").exists()


def test_a_dangling_symlink_at_pool_is_refused(shm_pool, tmp_path):
    shm_pool.symlink_to(tmp_path / "nowhere")
    line = one_error_line(serve(shm_pool, tmp_path / "s.sock"))
    assert "is a dangling symbolic link; kvtier never overwrites it" in line
    assert shm_pool.is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_pool_of_an_older_kvtier_layout_is_created_anew_and_a_current_one_taken_back_warm(tmp_path):
    """A pool file of kvtier's first layout (KVTNODE1) is kvtier's own: a real owner recreates it
    (warning in its log) and serves; its restart takes the new file back (same pool id, epoch 2)."""
    server = NodeServer(tmp_path)
    server.pool.write_bytes(b"KVTNODE1" + os.urandom(4088))
    try:
        server.start()
        header = server.pool.read_bytes()[:64]
        assert header[:8] == MAGIC
        assert re.search(r"is not a kvtier node pool of this kvtier version \(its first bytes are not b'KVTNODE2'\); creating the "
                         r"pool anew \(its values are lost\)",
                         server.log.read_text())
        assert server.stats().problem == ""
        stop_process(server.proc)  # SIGTERM: the pool file stays
        server.start()
        assert server.pool.read_bytes()[8:24] == header[8:24]  # the same pool, not created again
        assert int.from_bytes(server.pool.read_bytes()[40:48], "little") == 2  # epoch: two owner starts
    finally:
        server.stop()


def test_the_help_example_is_the_docs_example():
    """``node serve --help``'s example and docs/node.md's agree (the fresh-user tester found two pool paths)."""
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "node", "serve", "--help"], capture_output=True,
                          text=True, check=False, timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr
    example = next(line.strip(" │") for line in proc.stdout.splitlines() if "kvtier node serve --pool" in line)
    docs = DOCS.read_text()
    assert example.strip() in docs.splitlines()
    assert "mkdir -p /dev/shm/kvtier-node" in proc.stdout and "mkdir -p /dev/shm/kvtier-node" in docs.splitlines()


def test_a_socket_path_too_long_for_unix_is_refused_before_the_pool_is_created(shm_pool, tmp_path):
    """A --socket path over 107 bytes was a traceback (``AF_UNIX path too long``, exit 1) after the
    pool file and its lock had been created, both left behind; now one sentence, nothing created."""
    socket = tmp_path / ("x" * 120 + ".sock")
    line = one_error_line(serve(shm_pool, socket))
    num_bytes = len(os.fsencode(str(socket)))
    assert line == (f"error: --socket path is {num_bytes} bytes; a UNIX socket path holds at most 107: give a "
                    "shorter path")
    assert not shm_pool.exists() and not shm_pool.with_name(shm_pool.name + ".lock").exists()


def test_a_socket_the_kernel_cannot_bind_is_refused_and_the_pool_never_created(shm_pool):
    """``--socket /proc/n.sock`` (an existing directory where no socket can be made) was a
    FileNotFoundError traceback after the pool was created; the socket is now bound before the pool."""
    line = one_error_line(serve(shm_pool, Path("/proc/kvtier-test.sock")))
    assert line.startswith("error: cannot create the socket --socket /proc/kvtier-test.sock (")
    assert line.endswith("give a path in a writable directory, e.g. /dev/shm/kvtier-node/node.sock.")
    assert not shm_pool.exists() and not shm_pool.with_name(shm_pool.name + ".lock").exists()


@pytest.mark.parametrize("flag", ["--pool", "--socket"])
def test_a_path_under_a_regular_file_says_it_is_a_file(flag, shm_pool, tmp_path):
    """``--pool /some/file/pool`` said "directory /some/file does not exist" of an existing file
    (fault-injection tester); --socket said the same."""
    blocker = tmp_path / "afile"
    blocker.write_text("kept\n")
    pool, socket = (blocker / "pool", tmp_path / "s.sock") if flag == "--pool" else (shm_pool, blocker / "s.sock")
    line = one_error_line(serve(pool, socket))
    path = pool if flag == "--pool" else socket
    assert line.startswith(f"error: {flag} {path}: directory {blocker} is a file, not a directory; "), line
    assert blocker.read_text() == "kept\n"
    assert not shm_pool.exists() and not shm_pool.with_name(shm_pool.name + ".lock").exists()
    # a directory that is really missing is still called missing
    line = one_error_line(serve(tmp_path / "none" / "pool", tmp_path / "s.sock"))
    assert line.startswith(f"error: --pool {tmp_path / 'none' / 'pool'}: directory {tmp_path / 'none'} does not "
                           "exist; ")


def test_a_restart_with_another_node_gib_says_the_pool_was_created_anew_because_its_size_changed(tmp_path):
    """Restarting the owner on the same pool with another --node-gib logged "0 values taken back"
    without saying why (fault-injection tester); the log now says the size changed, from what to what."""
    first = NodeServer(tmp_path, node_gib=0.0625)
    try:
        first.start()
        assert "epoch 1, 0 values taken back (created anew: no pool file was there)" in first.log.read_text()
        stop_process(first.proc)  # SIGTERM: the pool file stays
        first.args[first.args.index("--node-gib") + 1] = "0.125"
        first.start()
        log = first.log.read_text()
        why = ("its size changed: it was made for --node-gib 0.0625 --page-kib 4, this start asks for --node-gib "
               "0.125 --page-kib 4")
        assert f"kvtier node: the pool {first.pool}: {why}; creating it anew (its values are lost" in log
        assert re.search(rf"epoch 1, 0 values taken back \(created anew: {re.escape(why)}\)", log), log
        assert first.pool.stat().st_size == 0.125 * (1 << 30)
        stop_process(first.proc)
        first.start()  # the same sizes again: taken back as it is, no reason given
        last = [line for line in first.log.read_text().splitlines() if "values taken back" in line][-1]
        assert last.endswith("epoch 2, 0 values taken back"), last
    finally:
        first.stop()
