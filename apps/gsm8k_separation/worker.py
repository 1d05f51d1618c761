"""The process edge of the actor and rollout workers: a request loop over two queues.

The parent sends ``(method, kwargs)``; the worker answers ``("ok", result)`` or, when the
method raises, ``("error", traceback text)`` and exits with the exception. ``("close", {})``
ends the loop after the handler's ``close``.
"""

from __future__ import annotations

import traceback
from typing import Any

OK = "ok"
ERROR = "error"
CLOSE = "close"


def serve(handler_type: type, spec: Any, inbox: Any, outbox: Any) -> None:
    """Build ``handler_type(spec)`` and answer requests until ``close``."""
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
        raise
