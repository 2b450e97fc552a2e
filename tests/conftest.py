"""Test-wide settings.

Triton kernels run on CPU tensors under the interpreter; the variable must be set before
`triton` is first imported, so it is set here, before any test module is collected.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
