"""SIGTERM and SIGHUP end a kvtier command the way Ctrl-C does, so the servers it started stop.

``bench compare`` and ``demo`` start vLLM servers and a redis-server in sessions of their own;
Python's default action for SIGTERM (exit at once, no ``finally``) left them running when a CI
timeout or ``kill`` stopped kvtier.

Every stop says so in one line on stderr: ``kvtier: stopped by SIGTERM; ...`` from the handler,
``kvtier: stopped by SIGINT (Ctrl-C); exiting with 130`` once Ctrl-C's KeyboardInterrupt left the
command (:func:`say_interrupted`; Ctrl-C had ended it silently with 130).  A command that leaves
files behind says what is left after that line (:func:`note_on_stop`: ``bench run --out DIR``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_replaced: dict[int, Any] = {}
"""The handlers :func:`_install` replaced, while its own are installed (empty otherwise)."""

_stopped_by: list[int] = []
"""The signal whose handler is ending the command (SIGTERM or SIGHUP), once it fired."""

_notes: list[str] = []
"""Lines :func:`note_on_stop` kept for :func:`say_notes`, as the stopped command unwound."""


@contextmanager
def note_on_stop(describe: Callable[[], str]) -> Iterator[None]:
    """If the block ends because the command was stopped (Ctrl-C, SIGTERM, SIGHUP), keep
    ``describe()``'s line (what the command left behind, read as it unwinds) for the stop message."""
    try:
        yield
    except KeyboardInterrupt:
        _notes.append(describe())
        raise
    except SystemExit:
        if _stopped_by:
            _notes.append(describe())
        raise


def say_notes() -> None:
    """Print (``kvtier: <line>`` on stderr) and forget the lines :func:`note_on_stop` kept."""
    for line in _notes:
        sys.stderr.write(f"kvtier: {line}\n")
    sys.stderr.flush()
    _notes.clear()


def say_interrupted() -> None:
    """The one line of a command that Ctrl-C (SIGINT) ended, then its notes."""
    sys.stderr.write(f"kvtier: stopped by SIGINT (Ctrl-C); exiting with {128 + signal.SIGINT}\n")
    say_notes()


_HANDLED = (signal.SIGTERM, signal.SIGHUP)
_HELD_ACROSS_FORK = (signal.SIGINT, *_HANDLED)
_held_for_fork: dict[int, bool] = {}
"""Forking threads (ident) that hold SIGINT/SIGTERM/SIGHUP blocked across a fork (:func:`_hold_before_fork`)."""
_libc = ctypes.CDLL(None, use_errno=True)


def _raw_sigmask(how: int, signals: tuple[int, ...]) -> None:
    """``pthread_sigmask`` through libc, not ``signal.pthread_sigmask``, which runs the handlers of the
    signals noted so far before it returns: in an at-fork callback the exception a handler raises
    (Ctrl-C's KeyboardInterrupt, kvtier's SystemExit for SIGTERM) is printed as "Exception ignored"
    and dropped, the signal with it (``kvtier simulate`` ran on to exit 0 after a Ctrl-C that most
    likely came as its pool forked: CI, ``test_ctrl_c_to_simulate_says_so``; a SIGTERM there left
    the command running with SIGTERM ignored).  (A ``sigset_t``: bit ``signum - 1``, little-endian
    words, Linux's 128 bytes, of which macOS reads the first 4.)"""
    mask = (ctypes.c_uint64 * 16)()
    for signum in signals:
        mask[(signum - 1) // 64] |= 1 << ((signum - 1) % 64)
    if _libc.pthread_sigmask(how, ctypes.byref(mask), None) != 0:
        raise OSError(ctypes.get_errno(), "pthread_sigmask failed")


def _hold_before_fork() -> None:
    """In the forking thread, while kvtier's handlers are installed: hold SIGINT, SIGTERM and SIGHUP
    blocked across the fork.  A SIGTERM that reached the child before :func:`_restore_in_child` ran was
    noted for kvtier's Python handler and then dropped, as Python drops a noted signal whose handler
    is by then the default: the child (a fork pool's worker, SIGTERMed by ``terminate()`` as it
    started) lived on, and the pool's join with it never returned.  Held, the kernel keeps it pending
    until the child has the default action, which then ends it.  In the parent, a signal that comes
    during the fork stays pending until the fork's callbacks are done (:func:`_raw_sigmask`)."""
    if _replaced:
        _raw_sigmask(signal.SIG_BLOCK, _HELD_ACROSS_FORK)
        _held_for_fork[threading.get_ident()] = True


def _release_in_parent() -> None:
    """The parent's side of :func:`_hold_before_fork`: the signals unblocked.  One that came during the
    fork is taken off the pending set first and sent again :data:`REDELIVER_S` later (a thread's
    ``os.kill``), so that the command's own code acts on it, never this callback: Python runs a
    handler at the next call its code makes, and an exception raised in an at-fork callback is
    dropped ("Exception ignored in ... _release_in_parent"), the signal with it."""
    if _held_for_fork.pop(threading.get_ident(), False):
        came = set(signal.sigpending()).intersection(_HELD_ACROSS_FORK)
        if came:
            signal.sigtimedwait(came, 0)  # (one pending instance per signal number: taken off, not acted on)
        _raw_sigmask(signal.SIG_UNBLOCK, _HELD_ACROSS_FORK)
        for signum in came:
            again = threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()


REDELIVER_S = 0.05
"""How long after a fork a signal that came during it is sent again (:func:`_release_in_parent`)."""


def _restore_in_child() -> None:
    """In a child forked while kvtier's handlers are installed, put the replaced handlers back at
    once (``os.register_at_fork``), then unblock the signals :func:`_hold_before_fork` held.  A
    Python-level handler only runs when the interpreter checks for signals: a ``multiprocessing``
    pool worker that ``Pool.terminate()`` SIGTERMs just before it blocks in ``sem_wait`` on the
    queue's lock then sleeps forever with the signal noted and never acted on, and the pool's
    ``join`` with it (seen: 1 in ~50 runs of ``with Pool(2)`` under kvtier's handler, the worker in
    ``synchronize.py __enter__``).  With the default action the kernel ends the worker, as without
    kvtier."""
    for signum, handler in _replaced.items():
        try:
            signal.signal(signum, handler)
        except (ValueError, OSError):  # not the main thread of the child: the handler's pid check stays
            pass
    _replaced.clear()
    held = _held_for_fork.pop(threading.get_ident(), False)
    _held_for_fork.clear()  # the child runs only the forking thread
    if held:
        _raw_sigmask(signal.SIG_UNBLOCK, _HELD_ACROSS_FORK)


os.register_at_fork(before=_hold_before_fork, after_in_parent=_release_in_parent,
                    after_in_child=_restore_in_child)


@contextmanager
def exit_on_termination() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread
    (see :func:`_install`); the previous handlers come back afterwards (and in any child forked
    meanwhile, at once: :func:`_restore_in_child`)."""
    previous = _install()
    _replaced.update(previous)
    try:
        yield
    finally:
        _replaced.clear()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _signal_child_sessions(signum: int) -> None:
    """Send ``signum`` to the process group of each child of this process that leads a session of its
    own (the servers kvtier starts with ``start_new_session``); other children are left alone."""
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid == me and os.getsid(pid) == pid:
                os.killpg(pid, signum)
        except (OSError, ValueError, IndexError):
            continue


def _install() -> dict[int, Any]:
    """Make SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so the ``finally`` blocks and context managers of a command run: ``bench
    compare`` and ``demo`` start vLLM servers and a redis-server in sessions of their own, which
    Python's default action (exit at once) left running when a CI timeout or ``kill`` stopped kvtier.
    Says so in one line on stderr; a second SIGTERM/SIGHUP while the servers stop is ignored, so it
    cannot cut their clean-up short (SIGKILL still ends kvtier at once).  Only in this process: a
    child forked from it (a ``multiprocessing`` fork pool's worker, which the pool ends with SIGTERM)
    dies of the signal as without the handler, silently.  Returns the handlers it replaced (none
    outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    owner_pid = os.getpid()

    def stop(signum: int, frame: Any) -> None:
        if os.getpid() != owner_pid:
            # a forked child (a multiprocessing pool worker: `simulate` sweeps in a fork pool, whose
            # terminate() SIGTERMs its workers) inherits this handler; it must die of the signal as it
            # would without kvtier, not print kvtier's message and exit as if it were the command
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if _inside_popen(frame):  # raising now would lose the handle of a child being started
            retry = threading.Timer(0.05, os.kill, (os.getpid(), signum))
            retry.daemon = True
            retry.start()
            return
        for other in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(other, signal.SIG_IGN)
        _stopped_by.append(signum)
        sys.stderr.write(f"kvtier: stopped by {signal.Signals(signum).name}; stopping what it started, then exiting "
                         f"with {128 + signum}\n")
        sys.stderr.flush()
        _signal_child_sessions(signal.SIGTERM)  # belt and braces: a child whose handle was lost all the same
        raise SystemExit(128 + signum)

    return {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}


def _inside_popen(frame: Any) -> bool:
    """Whether ``frame`` runs inside ``subprocess.Popen()``: an exception raised there after the fork
    leaves the new child (a vLLM server or redis-server in a session of its own) running, its
    ``Popen`` object never returned to the code that would stop it."""
    while frame is not None:
        if frame.f_code is subprocess.Popen.__init__.__code__:
            return True
        frame = frame.f_back
    return False
