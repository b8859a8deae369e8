"""Ctrl-C during `kvtier simulate`: the command ends as interrupted and says nothing from its pool workers."""

import os
import signal
import subprocess
import sys
import time

from kvtier.simulate.sweep import replay_map
from kvtier.simulate.synth import generate, make_params
from kvtier.tools.mooncake import write_records


def _children(pid: int) -> list[str]:
    """Process ids of ``pid``'s children (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return f.read().split()
    except FileNotFoundError:  # the process is gone: the loop's poll() says so
        return []


def test_ctrl_c_in_a_parallel_sweep_prints_nothing_from_the_workers(tmp_path):
    """Ctrl-C reaches the whole foreground process group; each pool worker's KeyboardInterrupt printed
    `Process ForkPoolWorker-N:` on stderr under the command's exit (tester4)."""
    trace = tmp_path / "chat.jsonl"
    write_records(trace, generate("chat", make_params("chat", {}), 20_000, 0))
    args = ["simulate", "--trace", str(trace), "--kv-bytes-per-token", "2048", "--engine-gib", "0.01",
            "--cpu-gib", "0.5,1,2,4", "--policy", "lru,belady", "--workers", "2"]
    # kvtier as a terminal's foreground command gets it: Ctrl-C raises KeyboardInterrupt. A test run in
    # the background (nohup, `cmd &`) passes SIGINT on ignored, and Python would then never raise it.
    as_foreground = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "sys.argv = ['kvtier'] + sys.argv[1:]; runpy.run_module('kvtier.cli.main', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", as_foreground, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 2:  # the pool's workers are replaying
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode in (130, -signal.SIGINT)  # Python may end by re-raising SIGINT (an uncaught KeyboardInterrupt)
    assert "ForkPoolWorker" not in err and "Traceback" not in err, err


def _sigint_disposition(_: int) -> object:
    return signal.getsignal(signal.SIGINT)


def test_the_replay_pool_workers_leave_sigint_to_the_parent():
    """The pool the sweep and --recommend replay in: every worker ignores SIGINT (the parent takes
    Ctrl-C and terminates them), whatever the parent's own handler."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive run has it
    try:
        assert replay_map(_sigint_disposition, range(4), 2) == [signal.SIG_IGN] * 4
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the parent's own is untouched
    finally:
        signal.signal(signal.SIGINT, before)


def _die_on_two(job: int) -> int:
    if job == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer ends a process
    return job * 10


def test_a_replay_process_that_dies_ends_the_wait_with_one_sentence():
    """multiprocessing.Pool.map waited forever for the job a killed worker held (a local run of the
    sweep hung there); the replays' pool ends the wait and says how to rerun."""
    import pytest

    from kvtier.core.errors import UserError

    assert replay_map(_die_on_two, [0, 1, 3], 2) == [0, 10, 30]
    started = time.monotonic()
    with pytest.raises(UserError, match="replay process .* died .* fewer --workers"):
        replay_map(_die_on_two, range(6), 2)
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 10
    while _children(os.getpid()) and time.monotonic() < deadline:  # no replay process left behind
        time.sleep(0.05)
    assert _children(os.getpid()) == []
