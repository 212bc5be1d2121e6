"""gh1, gpucr's GPU chunk hash, in numpy: a second, independent implementation of the
definition in gpu-state/src/image/gpuhash.rs, used on the GPU machine to check the digests
the kernel (hook/kernels/gpuhash.cu) wrote into an image against the bytes stored."""
import numpy as np

SEGMENT_WORDS = 8192
LANES = 256
P1 = np.uint64(0x9E3779B185EBCA87)
P2 = np.uint64(0xC2B2AE3D27D4EB4F)
P3 = np.uint64(0x165667B19E3779F9)
P4 = np.uint64(0x85EBCA77C2B2AE63)
P5 = np.uint64(0x27D4EB2F165667C5)
M = (1 << 64) - 1


def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _fmix(k):
    k = k ^ (k >> np.uint64(33))
    k = k * np.uint64(0xFF51AFD7ED558CCD)
    k = k ^ (k >> np.uint64(33))
    k = k * np.uint64(0xC4CEB9FE1A85EC53)
    return k ^ (k >> np.uint64(33))


def _fmix_int(k):
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M
    return k ^ (k >> 33)


def digest(data: bytes):
    """'zero' for an all-zero chunk, else the 32-hex-digit digest; None if len % 8."""
    if len(data) % 8:
        return None
    words = np.frombuffer(data, dtype="<u8")
    n = len(words)
    nseg = -(-n // SEGMENT_WORDS)
    padded = np.zeros(nseg * SEGMENT_WORDS, dtype=np.uint64)
    padded[:n] = words
    valid = np.zeros(nseg * SEGMENT_WORDS, dtype=bool)
    valid[:n] = True
    # [segment, step, lane]: lane t of segment s sees words t, t + LANES, ...
    w = padded.reshape(nseg, SEGMENT_WORDS // LANES, LANES)
    v = valid.reshape(nseg, SEGMENT_WORDS // LANES, LANES)
    t = np.arange(1, LANES + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        a = np.broadcast_to(t * P1, (nseg, LANES)).copy()
        b = np.broadcast_to((t * P2) ^ P5, (nseg, LANES)).copy()
        for j in range(SEGMENT_WORDS // LANES):
            wj, vj = w[:, j, :], v[:, j, :]
            na = _rotl(a + wj * P2, 31) * P1
            nb = _rotl(b ^ (wj * P4), 27) * P3 + P5
            a = np.where(vj, na, a)
            b = np.where(vj, nb, b)
        s = np.arange(nseg, dtype=np.uint64)[:, None]
        la = _fmix(a ^ (s * P3))
        lb = _fmix(b + s * P4)
    sum_a = int(la.sum(dtype=np.uint64))
    sum_b = int(lb.sum(dtype=np.uint64))
    if not words.any():
        return "zero"
    length = len(data)
    h0 = _fmix_int(sum_a ^ ((length * int(P1)) & M))
    lp = (length * int(P2)) & M
    h1 = _fmix_int(sum_b ^ (((lp << 29) | (lp >> 35)) & M))
    return h0.to_bytes(8, "little").hex() + h1.to_bytes(8, "little").hex()


def check_image(image_dir, limit=8):
    """Recomputes gh1 of up to `limit` stored raw chunks of an image; returns
    (checked, mismatches, first mismatch or None)."""
    import json
    import os
    m = json.load(open(os.path.join(image_dir, "manifest.json")))
    checked, bad, first = 0, 0, None
    for alloc in m["allocations"]:
        for c in alloc["chunks"]:
            at = c["at"]
            if "gpu_hash" not in c or not isinstance(at, dict) or "data" not in at:
                continue
            d = at["data"]
            if d["codec"] != "raw":
                continue
            with open(os.path.join(image_dir, m["files"][d["file"]]["name"]), "rb") as f:
                f.seek(d["offset"])
                data = f.read(c["len"])
            got = digest(data)
            checked += 1
            if got != c["gpu_hash"]:
                bad += 1
                first = first or {"va": alloc["va"], "offset": c["offset"], "kernel": c["gpu_hash"], "numpy": got}
            if checked >= limit:
                return checked, bad, first
    return checked, bad, first
