"""Ctrl-C during `kvtier simulate`: the command ends as interrupted and says nothing from its pool workers."""

import os
import signal
import subprocess
import sys
import time

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
    # 160 replays (80 capacities x 2 policies): about 10 s on 2 cores, so the sweep still runs when
    # Ctrl-C comes; with 8 (about 1 s) it could end first, and the command then exited 0 (a CI run)
    capacities = ",".join(f"{0.25 * i:g}" for i in range(1, 81))
    args = ["simulate", "--trace", str(trace), "--kv-bytes-per-token", "2048", "--engine-gib", "0.01",
            "--cpu-gib", capacities, "--policy", "lru,belady", "--workers", "2"]
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


_IN_A_FRESH_PROCESS = """
import os, signal, sys, time
from kvtier.core.errors import UserError
from kvtier.simulate.sweep import can_fork, replay_map

def disposition(_):
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN

def die_on_two(job):
    if job == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer ends a process
    return job * 10

assert can_fork()  # one thread: the replays fork
signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive run has it
assert replay_map(disposition, range(4), 2) == [True] * 4  # every replay process ignores SIGINT
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the parent's own is untouched
assert replay_map(die_on_two, [0, 1, 3], 2) == [0, 10, 30]
started = time.monotonic()
try:
    replay_map(die_on_two, range(6), 2)
except UserError as exc:
    print("refused:", exc, round(time.monotonic() - started))
"""


def test_the_replay_processes_leave_sigint_to_the_parent_and_a_dead_one_ends_the_wait():
    """The pool the sweep and --recommend replay in, in a process of one thread as `kvtier simulate`
    is: every replay process ignores SIGINT (the parent takes Ctrl-C and terminates them), and a
    replay process that dies ends the wait with one sentence (multiprocessing.Pool.map waited
    forever for the job a killed worker held)."""
    proc = subprocess.run([sys.executable, "-c", _IN_A_FRESH_PROCESS], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    refused, _, seconds = proc.stdout.strip().rpartition(" ")
    assert refused.startswith("refused: a replay process of the 2 started died") and "fewer --workers" in refused
    assert int(seconds) < 30


def test_a_threaded_caller_replays_in_its_own_process():
    """A child forked while another thread holds a lock can block forever (a replay forked from a
    pytest-xdist worker hung): with another thread running, the replays run one by one here."""
    import threading

    from kvtier.simulate.sweep import can_fork, replay_map

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        assert not can_fork()
        assert replay_map(lambda _: os.getpid(), range(3), 2) == [os.getpid()] * 3
    finally:
        stop.set()
        other.join()
