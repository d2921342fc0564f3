"""Suite-wide setup.

Without a GPU, Triton kernels run under its interpreter (TRITON_INTERPRET=1),
which must be set before any kernel module is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
