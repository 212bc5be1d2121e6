"""gpucr GPU end-to-end: a PyTorch workload that keeps a tensor on the GPU and changes it
deterministically, one step at a time (the PyTorch counterpart of workload.cu).

    python3 torch_workload.py GIB STEPS SLEEP_MS OUT

Lines "step S hash H" (OUT: appended, opened per line; - for stdout), "now S hash H" on SIGUSR1.
x_0 = arange(n) % 2^31; x_S = (x_{S-1} * 1103515245 + S) % 2^31 (int64, exact);
H = sum of x * (i % 7 + 1) (exact in int64).
"""
import signal
import sys
import time

import torch

MOD = 2**31


def main():
    if len(sys.argv) != 5:
        sys.exit("usage: torch_workload.py GIB STEPS SLEEP_MS OUT")
    gib, steps, pause_ms, out = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    n = int(gib * 2**30) // 8
    dev = torch.device("cuda")
    idx = torch.arange(n, dtype=torch.int64, device=dev)
    weight = (idx % 7) + 1
    x = idx % MOD
    del idx
    now = {"flag": False}
    signal.signal(signal.SIGUSR1, lambda *_: now.update(flag=True))

    def digest():
        return int((x * weight).sum().item()) & (2**64 - 1)

    def emit(what, s, h):
        line = f"{what} {s} hash {h:016x}\n"
        if out == "-":
            sys.stdout.write(line)
            sys.stdout.flush()
        else:
            with open(out, "a") as f:
                f.write(line)

    print(f"torch_workload: {n * 8} bytes on {torch.cuda.get_device_name(0)}", file=sys.stderr, flush=True)
    emit("step", 0, digest())
    s = 0
    while steps == 0 or s < steps:
        s += 1
        x.mul_(1103515245).add_(s).remainder_(MOD)
        emit("step", s, digest())
        for _ in range(2):
            if now["flag"]:
                now["flag"] = False
                emit("now", s, digest())
            if pause_ms > 0 and _ == 0:
                time.sleep(pause_ms / 1000)


if __name__ == "__main__":
    main()
