"""What test_staged runs in a spawned process: a writer that stops right before its commit.

Spawned processes import their target by module name, which pytest's importlib mode
does not provide for test modules; the test puts this folder on ``sys.path``.
"""

import time

from dte_transport import StagedLink


def commit_then_hang(root: str, committed: bytes, hanging: bytes, ready) -> None:
    """Commit ``committed``, write ``hanging`` up to its manifest's rename, then wait."""
    link = StagedLink(root)
    link.send(committed)

    def hang() -> None:
        ready.set()
        time.sleep(600)

    link._before_commit = hang
    link.send(hanging)
