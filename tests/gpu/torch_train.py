"""gpucr GPU end-to-end: a PyTorch training loop (an MLP with Adam on fixed synthetic data,
deterministic algorithms) whose loss sequence must be the same after a checkpoint/restore as in
an uninterrupted run (issue 4's correctness check).

    python3 torch_train.py GIB STEPS SLEEP_MS OUT

GIB sizes the model (hidden width), so the weights, gradients and Adam state take about GIB GiB.
Lines "step S hash H" with H the float32 bits of the loss of step S (OUT appended, - for
stdout); "now S hash H" on SIGUSR1 repeats step S's loss.
"""
import os
import signal
import struct
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402


def main():
    if len(sys.argv) != 5:
        sys.exit("usage: torch_train.py GIB STEPS SLEEP_MS OUT")
    gib, steps, pause_ms, out = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    d_in, d_out = 1024, 16
    # 3 hidden layers of width w: params ~ 2*w*w + 2*1024*w floats; x4 with grads and Adam.
    w = max(256, int(((gib * 2**30) / 4 / 4 / 2) ** 0.5))
    model = torch.nn.Sequential(
        torch.nn.Linear(d_in, w), torch.nn.ReLU(),
        torch.nn.Linear(w, w), torch.nn.ReLU(),
        torch.nn.Linear(w, w), torch.nn.ReLU(),
        torch.nn.Linear(w, d_out),
    ).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(99)
    data = torch.randn(256, d_in, generator=g).to(dev)
    target = torch.randn(256, d_out, generator=g).to(dev)
    now = {"flag": False}
    signal.signal(signal.SIGUSR1, lambda *_: now.update(flag=True))

    def emit(what, s, loss):
        bits = struct.unpack("<I", struct.pack("<f", loss))[0]
        line = f"{what} {s} hash {bits:016x}\n"
        if out == "-":
            sys.stdout.write(line)
            sys.stdout.flush()
        else:
            with open(out, "a") as f:
                f.write(line)

    nparams = sum(p.numel() for p in model.parameters())
    print(f"torch_train: width {w}, {nparams * 4 * 4 / 2**30:.2f} GiB of weights, grads and Adam state",
          file=sys.stderr, flush=True)
    with torch.no_grad():
        loss0 = torch.nn.functional.mse_loss(model(data), target).item()
    emit("step", 0, loss0)
    s, last = 0, loss0
    while steps == 0 or s < steps:
        s += 1
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        opt.step()
        last = loss.item()
        emit("step", s, last)
        for i in range(2):
            if now["flag"]:
                now["flag"] = False
                emit("now", s, last)
            if pause_ms > 0 and i == 0:
                time.sleep(pause_ms / 1000)


if __name__ == "__main__":
    main()
