"""The helpers that the multi-process tests spawn and end their rank processes with."""

from __future__ import annotations

import os
import signal
import time

from group_worker import finish, ranks, stop


def _reaped(pid: int) -> bool:
    """``pid`` is no longer a child of this process: exited and waited for (a zombie, or
    a child still running, is still one)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_finish_kills_and_reaps_a_rank_that_hangs():
    """A rank that exits and one that hangs: the hanging one is reported, killed and
    reaped (its exit code is SIGKILL's, it is no zombie left for later tests)."""
    context = ranks()
    done = context.Process(target=time.sleep, args=(0,))
    hanging = context.Process(target=time.sleep, args=(3600,))
    for process in (done, hanging):
        process.start()
    done.join()  # so that finish's deadline, cut short, can only find the hanging one
    hung, codes = finish([done, hanging], 0)
    assert ([hanging], [0, -signal.SIGKILL]) == (hung, codes)
    assert _reaped(hanging.pid)


def test_stop_reaps_every_started_process():
    """After an error (the test's ``finally``): a rank still running and one never
    started; the running one is killed and reaped, the other left alone."""
    context = ranks()
    running, never = (context.Process(target=time.sleep, args=(3600,)) for _ in range(2))
    running.start()
    stop([running, never])
    assert (-signal.SIGKILL, True, None) == (running.exitcode, _reaped(running.pid), never.pid)
