"""Keeps the GPU busy with 8192x8192 matmuls for argv[1] seconds (the "busy" recording)."""

import sys
import time

import torch

a = torch.randn(8192, 8192, device="cuda")
b = torch.randn(8192, 8192, device="cuda")
end = time.time() + float(sys.argv[1])
while time.time() < end:
    c = a @ b
    torch.cuda.synchronize()
