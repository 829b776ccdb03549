"""Without a GPU, Triton kernels run in the interpreter; set before `tandem.kernels` is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
