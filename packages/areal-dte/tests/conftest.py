"""Puts this folder on ``sys.path`` so the tests (and the ranks they spawn) can import
``sglang_world``; ``--import-mode=importlib`` does not add test folders."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
