"""Puts this folder on ``sys.path`` so the tests can import ``codec_cases``.

The workspace runs pytest with ``--import-mode=importlib``, which does not add test
folders to ``sys.path``; the helper module has a name no other package uses.
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
