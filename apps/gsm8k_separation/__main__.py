"""``uv run apps/gsm8k_separation`` (or ``python -m gsm8k_separation`` with apps/ on the path).

Run as a directory, this file is a script and Python puts the app's own folder first on
``sys.path``, where its modules (``data``, ``model``, ...) would shadow top-level modules of
those names. Replace that entry with apps/ so they load as the package
``gsm8k_separation``, which the spawned worker processes import by name as well.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    if not __package__:
        here = Path(__file__).resolve().parent
        if sys.path and Path(sys.path[0]).resolve() == here:
            sys.path[0] = str(here.parent)
        else:
            sys.path.insert(0, str(here.parent))
    from gsm8k_separation.cli import main

    sys.exit(main())
