"""The process edge of the actor and rollout workers: a request loop over two queues.

The parent sends ``(method, kwargs)``; the worker answers ``("ok", result)`` or, when the
method raises, ``("error", traceback text)`` and exits with code 1, leaving the traceback
to the parent (which shows it with ``--debug``). ``("close", {})`` ends the loop after the
handler's ``close``. Workers ignore SIGINT: Ctrl-C in a terminal reaches the whole process
group, and the parent, which owns the interrupt, stops them.
"""

from __future__ import annotations

import signal
import sys
import traceback
from typing import Any

OK = "ok"
ERROR = "error"
CLOSE = "close"


class WorkerError(RuntimeError):
    """A worker process raised or died; carries its traceback."""


class Interrupted(Exception):  # noqa: N818 - it is the event, not a failure
    """Ctrl-C or SIGTERM stopped the job; the workers are stopped and, with ``--out``,
    ``metrics.jsonl`` and ``sync.png`` hold the syncs that had finished."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records
        super().__init__(f"interrupted after {len(records)} syncs")


def serve(handler_type: type, spec: Any, inbox: Any, outbox: Any) -> None:
    """Build ``handler_type(spec)`` and answer requests until ``close``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        handler = handler_type(spec)
        outbox.put((OK, "ready"))
        while True:
            method, kwargs = inbox.get()
            result = getattr(handler, method)(**kwargs)
            outbox.put((OK, result))
            if method == CLOSE:
                return
    except BaseException:
        outbox.put((ERROR, traceback.format_exc()))
        outbox.close()
        outbox.join_thread()  # the answer reaches the parent before the process ends
        sys.exit(1)
