"""Lets `python data_tools/X.py` import the package from a source checkout (no install)."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
