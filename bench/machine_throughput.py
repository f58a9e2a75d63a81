"""The machine's own matrix-product and convolution throughput, as PyTorch
reaches it with the bench's thread count: the ceiling beside each stage's
GFLOP/s in docs/performance.md. Usage: python bench/machine_throughput.py [THREADS]"""
import sys
import time

import torch

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)


def best(f, reps=5):
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


for dtype in (torch.float32, torch.bfloat16):
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    s = best(lambda: a @ b)
    print(f"matmul {n}x{n}x{n} {str(dtype)[6:]}: {2 * n**3 / s / 1e9:.0f} GFLOP/s")
    # The VAE's typical 3x3 convolution: 256 channels at 128x128.
    c, hw = 256, 128
    x = torch.randn(1, c, hw, hw, dtype=dtype)
    conv = torch.nn.Conv2d(c, c, 3, padding=1).to(dtype)
    with torch.no_grad():
        s = best(lambda: conv(x))
    print(f"conv3x3 {c}->{c} at {hw}x{hw} {str(dtype)[6:]}: {2 * c * c * 9 * hw * hw / s / 1e9:.0f} GFLOP/s")
