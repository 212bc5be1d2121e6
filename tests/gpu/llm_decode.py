"""gpucr GPU end-to-end: an LLM server's decode loop — a Llama-shaped decoder (RMSNorm,
rotary attention with a KV cache, SwiGLU MLP, bf16, random weights from a fixed seed) answering
requests by greedy decoding. Every token after a checkpoint/restore must be the token an
uninterrupted run produced.

    python3 llm_decode.py GIB STEPS SLEEP_MS OUT

GIB sizes the model (number of layers at width 2048), so the weights take about GIB GiB; the
KV cache of one request is small beside them. Each step decodes one token; a request ends after
ANSWER tokens and the next starts from its own prompt. Lines "step S hash H": H is the request
number, position and token id of step S (OUT appended, - for stdout); "now S hash H" on SIGUSR1
repeats step S.
"""
import os
import signal
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

D, HEADS, FF, VOCAB = 2048, 16, 5632, 32000
PROMPT, ANSWER = 16, 48


def rms(x, w):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * w


def rope(x, pos):
    # x: [heads, 1 or T, hd]; pos: [T]
    hd = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=x.device).float() / hd))
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Model:
    def __init__(self, layers, dev):
        # On the GPU (Philox): gigabytes of weights in well under a second, the same on
        # every run of the same GPU and driver.
        g = torch.Generator(device=dev).manual_seed(4321)

        def w(*shape, scale):
            return (torch.randn(*shape, generator=g, device=dev) * scale).to(torch.bfloat16)

        self.embed = w(VOCAB, D, scale=0.02)
        self.head = w(VOCAB, D, scale=0.02)
        self.norm = torch.ones(D, dtype=torch.bfloat16, device=dev)
        self.layers = []
        for _ in range(layers):
            self.layers.append({
                "wq": w(D, D, scale=D ** -0.5), "wk": w(D, D, scale=D ** -0.5),
                "wv": w(D, D, scale=D ** -0.5), "wo": w(D, D, scale=D ** -0.5),
                "w1": w(FF, D, scale=D ** -0.5), "w3": w(FF, D, scale=D ** -0.5),
                "w2": w(D, FF, scale=FF ** -0.5),
                "n1": torch.ones(D, dtype=torch.bfloat16, device=dev),
                "n2": torch.ones(D, dtype=torch.bfloat16, device=dev),
            })

    def forward(self, tokens, pos, cache):
        """tokens [T] at positions pos [T]; cache: per layer (k, v) [heads, len, hd] or None."""
        hd = D // HEADS
        x = self.embed[tokens]
        for i, L in enumerate(self.layers):
            h = rms(x, L["n1"])
            q = (h @ L["wq"].T).view(-1, HEADS, hd).transpose(0, 1)
            k = (h @ L["wk"].T).view(-1, HEADS, hd).transpose(0, 1)
            v = (h @ L["wv"].T).view(-1, HEADS, hd).transpose(0, 1)
            q, k = rope(q, pos), rope(k, pos)
            if cache[i] is not None:
                k = torch.cat((cache[i][0], k), dim=1)
                v = torch.cat((cache[i][1], v), dim=1)
            cache[i] = (k, v)
            att = (q @ k.transpose(1, 2)).float() / hd ** 0.5
            t, s = q.shape[1], k.shape[1]
            mask = torch.ones(t, s, device=x.device, dtype=torch.bool).tril(s - t)
            att = att.masked_fill(~mask, float("-inf")).softmax(-1).to(x.dtype)
            o = (att @ v).transpose(0, 1).reshape(-1, D)
            x = x + o @ L["wo"].T
            h = rms(x, L["n2"])
            x = x + (torch.nn.functional.silu(h @ L["w1"].T) * (h @ L["w3"].T)) @ L["w2"].T
        return rms(x[-1:], self.norm) @ self.head.T


def main():
    if len(sys.argv) != 5:
        sys.exit("usage: llm_decode.py GIB STEPS SLEEP_MS OUT")
    gib, steps, pause_ms, out = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    per_layer = (4 * D * D + 3 * D * FF) * 2
    layers = max(1, int((gib * 2**30 - 2 * VOCAB * D * 2) // per_layer))
    model = Model(layers, dev)
    print(f"llm_decode: {layers} layers of width {D}, "
          f"{(layers * per_layer + 2 * VOCAB * D * 2) / 2**30:.2f} GiB of bf16 weights",
          file=sys.stderr, flush=True)
    now = {"flag": False}
    signal.signal(signal.SIGUSR1, lambda *_: now.update(flag=True))

    def emit(what, s, req, i, tok):
        line = f"{what} {s} hash {req:06x}{i:04x}{tok:06x}\n"
        if out == "-":
            sys.stdout.write(line)
            sys.stdout.flush()
        else:
            with open(out, "a") as f:
                f.write(line)

    s, req = 0, 0
    last = (0, 0, 0)
    with torch.no_grad():
        while True:
            # A request: its prompt from its own seed, prefill, then greedy decode.
            g = torch.Generator(device="cpu").manual_seed(1000 + req)
            prompt = torch.randint(0, VOCAB, (PROMPT,), generator=g).to(dev)
            cache = [None] * len(model.layers)
            logits = model.forward(prompt, torch.arange(PROMPT, device=dev), cache)
            for i in range(ANSWER):
                tok = int(logits.argmax(-1).item())
                last = (req, i, tok)
                emit("step", s, req, i, tok)
                if steps and s >= steps:
                    return
                s += 1
                for k in range(2):
                    if now["flag"]:
                        now["flag"] = False
                        emit("now", s - 1, *last)
                    if pause_ms > 0 and k == 0:
                        time.sleep(pause_ms / 1000)
                pos = torch.tensor([PROMPT + i], device=dev)
                logits = model.forward(torch.tensor([tok], device=dev), pos, cache)
            req += 1


if __name__ == "__main__":
    main()
