"""SIGTERM/SIGHUP end a kvtier command the way Ctrl-C does: its ``finally`` blocks run (breaker F8).

The end-to-end case (``bench compare`` stops its vLLM server and private redis-server) is in
tests/bench/test_replicas.py; this one covers a signal that arrives while a child is being started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

from tests.processes import pids_mentioning

SCRIPT = """
import os, signal, subprocess, sys, threading, time
from kvtier.cli.termination import exit_on_termination
guard = exit_on_termination()  # held: the handlers live as long as the block
guard.__enter__()
# SIGTERM arrives while Popen() waits for the child's exec (its preexec_fn sleeps): a handler that
# raised there would lose the child's handle, and the child would run on in its own session.
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
proc = None
try:
    proc = subprocess.Popen(["sleep", sys.argv[1]], preexec_fn=lambda: time.sleep(1.0),
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sys.stdout.write("started\\n")  # one write: print() writes the newline apart, and a SIGTERM that a
    sys.stdout.flush()              # loaded host delays past Popen could land between the two
    time.sleep(30)
finally:
    if proc is not None:
        proc.kill()
        proc.wait()
        print("stopped the child", flush=True)
"""


def test_sigterm_while_a_child_starts_still_stops_the_child() -> None:
    marker = f"60.{uuid.uuid4().int % 10**12:012d}"  # the child's `sleep` time: unique to this test run
    result = subprocess.run([sys.executable, "-c", SCRIPT, marker], check=False, capture_output=True, text=True, timeout=60)
    leaked = pids_mentioning(marker)
    for pid in leaked:  # ours: clean up before asserting
        os.kill(pid, signal.SIGKILL)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "kvtier: stopped by SIGTERM" in result.stderr
    assert result.stdout.split() == ["started", "stopped", "the", "child"]
    assert leaked == []


FORK_SCRIPT = """
import multiprocessing, os, signal, sys, time
from kvtier.cli.termination import exit_on_termination
with exit_on_termination():
    pid = os.fork()
    if pid == 0:  # a forked child inherits the handler: SIGTERM must kill it, silently
        time.sleep(30)
        os._exit(0)
    time.sleep(0.3)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}")
    # a fork pool's terminate() (what `with Pool()` does on leaving) SIGTERMs its idle workers
    with multiprocessing.get_context("fork").Pool(2) as pool:
        print("pool", sum(pool.map(abs, [-1, -2, -3])))
print("done")
"""


def test_sigterm_to_a_forked_child_kills_it_without_kvtier_message() -> None:
    # before the fix the child ran kvtier's handler: "kvtier: stopped by SIGTERM ... exiting with 143"
    # on stderr (once per pool worker), exit status 143 for the child, 0 for the command
    result = subprocess.run([sys.executable, "-c", FORK_SCRIPT], check=False, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["child", str(int(signal.SIGTERM)), "pool", "6", "done"]
    assert "stopped by" not in result.stderr


def test_a_child_forked_under_the_handler_has_the_default_action_from_its_first_instruction() -> None:
    # a Python-level handler acts only when the interpreter next checks for signals: a pool worker
    # SIGTERMed just before it blocked in sem_wait on the pool's queue lock slept forever, and the
    # pool's join with it (1 in ~50 runs of the FORK_SCRIPT pool above hung in CI before the fix)
    from kvtier.cli.termination import exit_on_termination

    with exit_on_termination():
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)  # kvtier's, in this process
        pid = os.fork()
        if pid == 0:
            os._exit(0 if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
                     and signal.getsignal(signal.SIGHUP) == signal.SIG_DFL else 1)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the forked child kept kvtier's SIGTERM handler"


RACE_SCRIPT = """
import os, signal, sys, time
from kvtier.cli.termination import exit_on_termination
survived = 0
with exit_on_termination():
    for _ in range(int(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            time.sleep(1)
            os._exit(0)
        os.kill(pid, signal.SIGTERM)  # at once: often before the child has run a single instruction
        _, status = os.waitpid(pid, 0)
        survived += not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)
print("survived", survived)
"""


def test_a_sigterm_that_reaches_a_child_before_its_fork_hooks_still_ends_it() -> None:
    # Python notes a signal for the handler in place when it arrives and drops it if the handler is the
    # default by the time it acts: a child SIGTERMed before the at-fork hook restored the default lived
    # on (a fork pool's join then never returned: `simulate` hung after Ctrl-C's line)
    result = subprocess.run([sys.executable, "-c", RACE_SCRIPT, "40"], check=False, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["survived", "0"], result.stdout + result.stderr


FORK_SIGNAL_SCRIPT = """
import os, signal, sys, time
signum = int(sys.argv[1])
# registered before kvtier's hooks: runs after its before-fork hook has blocked the signals, so the
# signal is sent in the middle of the fork, and this after-fork hook runs before kvtier's
os.register_at_fork(before=lambda: os.kill(os.getpid(), signum), after_in_parent=lambda: None)
from kvtier.cli.termination import exit_on_termination
signal.signal(signal.SIGINT, signal.default_int_handler)
with exit_on_termination():
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(5.0)
    except KeyboardInterrupt:
        sys.stdout.write("interrupted\\n")
        sys.exit(130)
sys.stdout.write("lost\\n")
sys.exit(1)
"""


def test_a_signal_that_comes_during_a_fork_still_stops_the_command() -> None:
    """Ctrl-C or SIGTERM sent while the command forks (a ``simulate`` sweep's pool starting) is acted on
    in the command's own code: before the fix, kvtier's after-fork hook unblocked it with Python's
    ``pthread_sigmask``, whose handler run raised inside the hook, where Python drops the exception
    ("Exception ignored in ... _release_in_parent"), the signal with it: the command ran on (``simulate``
    exited 0 after a Ctrl-C on CI) and, for SIGTERM, with SIGTERM and SIGHUP ignored from then on."""
    for signum, code, line in ((signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, None)):
        proc = subprocess.run([sys.executable, "-c", FORK_SIGNAL_SCRIPT, str(int(signum))], check=False,
                              capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == code, (signum, proc.returncode, proc.stdout, proc.stderr[-2000:])
        assert "Exception ignored" not in proc.stderr
        if line is not None:
            assert proc.stdout.splitlines() == [line]
        else:
            assert "kvtier: stopped by SIGTERM" in proc.stderr and "lost" not in proc.stdout
