"""The machine's own matrix-product and convolution throughput, as PyTorch
reaches it with the bench's thread count: the ceiling beside each stage's
GFLOP/s in docs/performance.md.

Usage: python bench/machine_throughput.py [THREADS]
       python bench/machine_throughput.py --products M,K,N[;M,K,N...] [--threads T] [--runs R]
The second form is `sdhost bench --products --peer diffusers`'s peer: for
each shape it times `x @ wᵀ` (x: M×K activations, w: N×K weights, what a
linear layer computes) in f32 and bf16 and prints one JSON object with the
best of R runs in GFLOP/s; bf16 is null where it took over 10 times f32's
time on its first run (no native bf16 on the processor)."""
import json
import sys
import time

try:
    import torch
except ImportError as e:
    print(f"unavailable: torch is not importable ({e})", file=sys.stderr)
    sys.exit(3)


def best(f, reps=5):
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def products(spec, threads, runs):
    torch.set_num_threads(threads)
    out = {"threads": threads, "torch": torch.__version__, "products": []}
    for item in spec.split(";"):
        m, k, n = (int(v) for v in item.split(","))
        flop = 2.0 * m * k * n
        row = {"m": m, "k": k, "n": n}
        f32_s = None
        for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            x = torch.randn(m, k).to(dtype)
            w = torch.randn(n, k).to(dtype)
            with torch.no_grad():
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                first = time.perf_counter() - t0
                if name == "bf16" and f32_s is not None and first > 10 * f32_s:
                    row[name] = None
                    continue
                s = best(lambda: torch.nn.functional.linear(x, w), reps=runs)
            if name == "f32":
                f32_s = s
            row[name] = flop / s / 1e9
        out["products"].append(row)
    print(json.dumps(out))


def main():
    args = sys.argv[1:]
    if args and args[0] == "--products":
        spec = args[1]
        threads = int(args[args.index("--threads") + 1]) if "--threads" in args else 2
        runs = int(args[args.index("--runs") + 1]) if "--runs" in args else 3
        products(spec, threads, runs)
        return
    threads = int(args[0]) if args else 2
    torch.set_num_threads(threads)
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


if __name__ == "__main__":
    main()
