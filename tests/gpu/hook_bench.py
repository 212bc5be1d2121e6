#!/usr/bin/env python3
"""gpucr hook fast path on the GPU machine, without containerd: the workload (workload.cu) runs on
the host with libgpucr_hook.so preloaded; this script drives the hook's control socket and the
driver's checkpoint API (drive.c) the way the shim does, times every step, and checks the
workload's device memory against an uninterrupted reference run.

  hook_bench.py --workload W --drive D --hook LIB --gib G [--static-gib S] --ref REF
                --tmpfs DIR --disk DIR --out RESULTS.jsonl [--label L]

One process, side by side:
  driver  the driver alone moves all device memory (lock+checkpoint, restore+unlock), as today
  fast    hook Freeze -> CopyOut (tmpfs) -> Release -> driver lock+checkpoint of the rest ->
          driver restore+unlock -> Remap -> CopyIn -> Thaw (a leave-running checkpoint)
  disk    the same copy-out into a directory on local disk (then Thaw, no release)
  incr    a second copy-out with the first image as parent (unchanged static memory dedups)
  fastincr  the fast cycle again with the first image as parent (a periodic leave-running
          checkpoint of unchanged weights)
  keep, keepincr  fast and fastincr as the shim runs them now: Release {keep} hands the
          memory's fds to this script, which holds them across the driver's cycle, and
          Reattach maps the same memory back (no Remap, no CopyIn)
  snap, snapincr  a leave-running checkpoint of a running task as the shim runs it now:
          Freeze -> Snapshot (device-to-device copy, all released and kept) -> driver
          cycle -> Reattach -> Thaw, then WriteSnapshot (the image) while the workload
          runs; snapincr with the snap image as parent
  same    a full copy-out, Thaw, and at once Freeze and a second copy-out with the first as
          parent: an incremental checkpoint of unchanged memory (the workload steps every
          300 ms; copied_mib says whether it changed in between)
Every result is one JSON line in --out; a summary line per phase goes to stdout.
"""
import argparse
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import e2e_helper  # same directory: the reference check shared with h200-e2e.sh


def log(msg):
    print(f"[hook_bench] {msg}", flush=True)


def gh1_check(image_dir, record):
    """The kernel's gh1 digests in the image against numpy's (gh1.py) over the stored bytes."""
    try:
        import gh1
        checked, bad, first = gh1.check_image(image_dir, limit=6)
    except ImportError as e:
        record("gh1", error=f"cannot check: {e}")
        return
    if checked:
        record("gh1", image=os.path.basename(image_dir), checked=checked, mismatches=bad, first=first)


def compare_images(a, b):
    """Chunks of the allocations both images hold, by address: how many have the same
    content (gh1 digest, or CRC32C where there is none; zero chunks by their mark), per
    allocation size."""
    def chunks(d):
        m = json.load(open(os.path.join(d, "manifest.json")))
        out = {}
        for al in m["allocations"]:
            out[al["va"]] = (al["size"], ["zero" if c["at"] == "zero"
                                          else c.get("gpu_hash") or c.get("crc32c")
                                          for c in al["chunks"]])
        return out
    ca, cb = chunks(a), chunks(b)
    per = []
    for va in sorted(set(ca) & set(cb)):
        (size, xa), (_, xb) = ca[va], cb[va]
        per.append({"mib": size >> 20, "chunks": len(xa),
                    "same": sum(1 for x, y in zip(xa, xb) if x == y)})
    return {"allocations": per, "only_in_one": len(set(ca) ^ set(cb))}


class Hook:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(180)
        self.s.connect(path)

    def call(self, verb, **args):
        req = dict(verb=verb, **args)
        data = json.dumps(req).encode()
        t0 = time.monotonic()
        self.s.sendall(struct.pack(">I", len(data)) + data)
        hdr = self._read(4)
        (n,) = struct.unpack(">I", hdr)
        reply = json.loads(self._read(n))
        ms = (time.monotonic() - t0) * 1000
        if "error" in reply:
            raise RuntimeError(f"hook {verb}: {reply['error']}")
        ok = reply.get("ok")
        body = next(iter(ok.values())) if isinstance(ok, dict) else {}
        return ms, body

    def release(self, keep):
        """Release; with keep, also the fds of the kept memory (batches after the reply)."""
        return self.with_fds("Release", keep=keep)

    def snapshot(self):
        """Snapshot: the fds of the memory and of the snapshot follow the reply."""
        return self.with_fds("Snapshot")

    def with_fds(self, verb, **args):
        ms, body = self.call(verb, **args)
        held = body.get("held") or body.get("release", {}).get("held") or []
        fds = []
        t0 = time.monotonic()
        while len(fds) < len(held):
            msg, got, _flags, _addr = socket.recv_fds(self.s, 1, 128)
            if not msg:
                raise RuntimeError("hook closed the connection while sending kept memory")
            fds.extend(got)
        return ms + (time.monotonic() - t0) * 1000, body, held, fds

    def reattach(self, held, fds):
        req = json.dumps(dict(verb="Reattach", held=held)).encode()
        t0 = time.monotonic()
        self.s.sendall(struct.pack(">I", len(req)) + req)
        for i in range(0, len(fds), 128):
            socket.send_fds(self.s, [b"F"], fds[i:i + 128])
        hdr = self._read(4)
        (n,) = struct.unpack(">I", hdr)
        reply = json.loads(self._read(n))
        for fd in fds:
            os.close(fd)
        if "error" in reply:
            raise RuntimeError(f"hook Reattach: {reply['error']}")
        return (time.monotonic() - t0) * 1000

    def _read(self, n):
        buf = b""
        while len(buf) < n:
            part = self.s.recv(n - len(buf))
            if not part:
                raise RuntimeError("hook closed the connection")
            buf += part
        return buf


def drive(drive_bin, action, pid):
    """drive.c: returns {action: ms}; raises on failure."""
    out = subprocess.run([drive_bin, *action.split(), str(pid)], capture_output=True, text=True, timeout=300)
    res = {}
    for line in out.stdout.splitlines():
        parts = dict(p.split("=", 1) for p in line.split()[2:] if "=" in p)
        res[line.split()[1]] = float(parts.get("ms", "nan"))
    if out.returncode != 0:
        raise RuntimeError(f"drive {action} {pid}: {out.stdout.strip()} {out.stderr.strip()}")
    return res


class RssSampler(threading.Thread):
    """Peak RSS growth of a process while a phase runs."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.stop, self.base, self.peak = pid, False, rss(pid), 0

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, rss(self.pid) - self.base)
            time.sleep(0.02)

    def done(self):
        self.stop = True
        self.join()
        return self.peak


def rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def du(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def lines(path):
    """The workload's lines so far ([] before its file exists)."""
    try:
        return e2e_helper.read_lines(path)
    except OSError:
        return []


def last_step(path):
    steps = [s for k, s, _ in lines(path) if k == "step"]
    return steps[-1] if steps else -1


def wait_step(path, pid, want, secs):
    t0 = time.monotonic()
    while time.monotonic() - t0 < secs:
        if last_step(path) >= want:
            return True
        if not os.path.exists(f"/proc/{pid}"):
            return False
        time.sleep(0.1)
    return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--drive", required=True)
    ap.add_argument("--hook", required=True)
    ap.add_argument("--gib", required=True)
    ap.add_argument("--static-gib", default="0")
    ap.add_argument("--ref", required=True)
    ap.add_argument("--tmpfs", required=True)
    ap.add_argument("--disk", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--phases", default="driver,fast,disk,incr")
    a = ap.parse_args()
    label = a.label or f"{a.gib}+{a.static_gib}GiB"
    phases = a.phases.split(",")
    work = os.path.join(a.tmpfs, f"bench-{label}")
    shutil.rmtree(work, ignore_errors=True)
    sock_dir = os.path.join(work, "sock")
    os.makedirs(sock_dir)
    steps = os.path.join(work, "steps")
    env = dict(os.environ, LD_PRELOAD=a.hook, GPUCR_HOOK_SOCKET_DIR=sock_dir, GPUCR_HOOK_LOG="1")
    args = [a.workload, a.gib, "0", "300", steps]
    if a.static_gib != "0":
        args.append(a.static_gib)
    errlog = open(os.path.join(work, "workload.stderr"), "w")
    proc = subprocess.Popen(args, env=env, stdout=errlog, stderr=errlog)
    out = open(a.out, "a")

    def record(phase, **kv):
        row = {"label": label, "phase": phase, **kv}
        out.write(json.dumps(row) + "\n")
        out.flush()
        log(f"{label} {phase}: " + " ".join(f"{k}={v}" for k, v in kv.items()))

    def now_line():
        n = sum(1 for k, _, _ in lines(steps) if k == "now")
        os.kill(proc.pid, signal.SIGUSR1)
        for _ in range(100):
            got = [x for x in lines(steps) if x[0] == "now"]
            if len(got) > n:
                return got[-1]
            time.sleep(0.1)
        raise RuntimeError("no 'now' line after SIGUSR1")

    ok_all = True
    try:
        if not wait_step(steps, proc.pid, 3, 240):
            raise RuntimeError(f"workload did not reach step 3: {open(errlog.name).read()[-800:]}")
        sock = os.path.join(sock_dir, f"hook-{proc.pid}.sock")
        if not os.path.exists(sock):
            raise RuntimeError(f"no hook socket {sock}: {open(errlog.name).read()[-800:]}")
        h = Hook(sock)
        _, st = h.call("Status")
        record("status", allocations=st.get("allocations"), bytes=st.get("bytes"),
               unsupported=len(st.get("unsupported", [])), state=st.get("state"))
        if st.get("unsupported"):
            raise RuntimeError(f"hook reports unsupported memory: {st['unsupported'][:3]}")
        dev_bytes = st.get("bytes", 0)

        if "driver" in phases:
            before = now_line()
            s = RssSampler(proc.pid)
            s.start()
            t0 = time.monotonic()
            q = drive(a.drive, "quiesce", proc.pid)
            r = drive(a.drive, "resume", proc.pid)
            total = (time.monotonic() - t0) * 1000
            peak = s.done()
            after = now_line()
            record("driver", lock_ms=q.get("lock"), d2h_ms=q.get("checkpoint"),
                   h2d_ms=r.get("restore"), unlock_ms=r.get("unlock"), pause_ms=round(total, 1),
                   d2h_gbps=round(dev_bytes / q.get("checkpoint", 1) / 1e6, 2),
                   peak_rss_growth_mib=peak >> 20, now_before=before[2], now_after=after[2])

        img1 = os.path.join(a.tmpfs, f"img-{label}")
        shutil.rmtree(img1, ignore_errors=True)
        def leave_running_cycle(img, parent, keep=False):
            """Freeze -> CopyOut -> Release -> driver lock+checkpoint (of the rest) ->
            restore+unlock -> Remap -> CopyIn -> Thaw, as the shim runs a leave-running
            checkpoint (with keep: Release {keep} -> ... -> Reattach -> Thaw); the ms of
            every step and the hook's reports."""
            c = {"rm": 0.0, "ci": 0.0, "cin": {}, "ra": 0.0, "kept": 0}
            t0 = time.monotonic()
            c["fz"], _ = h.call("Freeze")
            c["co"], c["rep"] = h.call("CopyOut", image_dir=img, parent=parent)
            c["rl"], c["rel"], held, fds = h.release(keep)
            # Copy-in helpers (if set up) make their contexts while the driver works:
            # Warm before its restore, as the shim would (GPUCR_BENCH_WARM=checkpoint:
            # before its checkpoint of the rest instead).
            early = os.environ.get("GPUCR_BENCH_WARM") == "checkpoint"
            # GPUCR_BENCH_WARM_IMAGE=1: Warm names the image, so the helpers pin their
            # shares ahead (while the driver works) and the copy-in only sends the memory.
            wargs = {"image_dir": img} if os.environ.get("GPUCR_BENCH_WARM_IMAGE") == "1" else {}
            c["wm"], c["warm"] = h.call("Warm", **wargs) if not keep and early else (0.0, {})
            c["q"] = drive(a.drive, "quiesce", proc.pid)
            c["left_ms"] = (time.monotonic() - t0) * 1000
            if not keep and not early:
                c["wm"], c["warm"] = h.call("Warm", **wargs)
            c["r"] = drive(a.drive, "resume", proc.pid)
            if fds:
                c["kept"] = len(fds)
                c["ra"] = h.reattach(held, fds)
            else:
                c["rm"], _ = h.call("Remap")
                c["ci"], c["cin"] = h.call("CopyIn", image_dir=img)
            c["th"], _ = h.call("Thaw")
            c["total"] = (time.monotonic() - t0) * 1000
            return c

        def record_keep(phase, c):
            rep, q, r = c["rep"], c["q"], c["r"]
            record(phase, kept=c["kept"], freeze_ms=round(c["fz"], 1),
                   copy_out_ms=round(c["co"], 1),
                   copy_out_gbps=round(rep.get("bytes", 0) / c["co"] / 1e6, 2),
                   copied_mib=rep.get("copied_bytes", 0) >> 20,
                   parent_chunks=rep.get("parent_chunks"), release_ms=round(c["rl"], 1),
                   driver_lock_ms=q.get("lock"), driver_d2h_ms=q.get("checkpoint"),
                   driver_h2d_ms=r.get("restore"), driver_unlock_ms=r.get("unlock"),
                   reattach_ms=round(c["ra"], 1), remap_ms=round(c["rm"], 1),
                   copy_in_ms=round(c["ci"], 1), thaw_ms=round(c["th"], 1),
                   pause_ms=round(c["total"], 1), out_profile=rep.get("profile"))

        def snapshot_cycle(img, parent):
            """Freeze -> Snapshot -> driver lock+checkpoint (of the rest) -> restore+unlock
            -> Reattach -> Thaw (the workload's pause), then WriteSnapshot while it runs."""
            c = {}
            t0 = time.monotonic()
            c["fz"], _ = h.call("Freeze")
            c["sn"], c["snap"], held, fds = h.snapshot()
            c["q"] = drive(a.drive, "quiesce", proc.pid)
            c["r"] = drive(a.drive, "resume", proc.pid)
            c["kept"] = len(fds)
            c["ra"] = h.reattach(held, fds)
            c["th"], _ = h.call("Thaw")
            c["pause"] = (time.monotonic() - t0) * 1000
            step0 = last_step(steps)
            c["wr"], c["rep"] = h.call("WriteSnapshot", image_dir=img, parent=parent)
            c["total"] = (time.monotonic() - t0) * 1000
            c["steps_during_write"] = last_step(steps) - step0
            return c

        def record_snap(phase, c):
            rep, q, r, sn = c["rep"], c["q"], c["r"], c["snap"]
            record(phase, kept=c["kept"], pause_ms=round(c["pause"], 1),
                   freeze_ms=round(c["fz"], 1), snapshot_ms=round(c["sn"], 1),
                   snapshot_copy_ms=round(sn.get("copy_seconds", 0) * 1000, 1),
                   snapshot_mib=sn.get("snapshot_bytes", 0) >> 20,
                   driver_lock_ms=q.get("lock"), driver_d2h_ms=q.get("checkpoint"),
                   driver_h2d_ms=r.get("restore"), driver_unlock_ms=r.get("unlock"),
                   reattach_ms=round(c["ra"], 1), thaw_ms=round(c["th"], 1),
                   write_ms=round(c["wr"], 1),
                   write_gbps=round(rep.get("bytes", 0) / c["wr"] / 1e6, 2),
                   copied_mib=rep.get("copied_bytes", 0) >> 20,
                   parent_chunks=rep.get("parent_chunks"), total_ms=round(c["total"], 1),
                   steps_during_write=c["steps_during_write"],
                   peak_rss_growth_mib=c.get("peak", 0) >> 20, out_profile=rep.get("profile"))

        if "fast" in phases:
            wait_step(steps, proc.pid, last_step(steps) + 1, 30)
            s = RssSampler(proc.pid)
            s.start()
            c = leave_running_cycle(img1, None)
            peak = s.done()
            rep, rel, q, r, cin = c["rep"], c["rel"], c["q"], c["r"], c["cin"]
            record("fast", freeze_ms=round(c["fz"], 1), copy_out_ms=round(c["co"], 1),
                   copy_out_gbps=round(rep.get("bytes", 0) / c["co"] / 1e6, 2),
                   peak_staging_mib=rep.get("peak_staging_bytes", 0) >> 20,
                   release_ms=round(c["rl"], 1), released_mib=rel.get("bytes", 0) >> 20,
                   driver_lock_ms=q.get("lock"), driver_d2h_ms=q.get("checkpoint"),
                   gpu_empty_after_ms=round(c["left_ms"], 1),
                   driver_h2d_ms=r.get("restore"), driver_unlock_ms=r.get("unlock"),
                   remap_ms=round(c["rm"], 1), copy_in_ms=round(c["ci"], 1),
                   copy_in_gbps=round(cin.get("bytes", 0) / c["ci"] / 1e6, 2),
                   thaw_ms=round(c["th"], 1), pause_ms=round(c["total"], 1),
                   image_mib=du(img1) >> 20, peak_rss_growth_mib=peak >> 20,
                   out_profile=rep.get("profile"), in_profile=cin.get("profile"),
                   mapped_reads=cin.get("mapped_reads"),
                   warm_ms=round(c.get("wm", 0.0), 1), warm=c.get("warm"),
                   helpers=cin.get("helpers"),
                   copied_mib=rep.get("copied_bytes", 0) >> 20,
                   zero_chunks=rep.get("zero_chunks"), parent_chunks=rep.get("parent_chunks"))
            gh1_check(img1, record)

        if "fastincr" in phases and os.path.isdir(img1):
            # A second leave-running checkpoint with the first image as parent: what a
            # periodic checkpoint of a server with unchanged weights pauses for.
            img4 = os.path.join(a.tmpfs, f"img4-{label}")
            shutil.rmtree(img4, ignore_errors=True)
            wait_step(steps, proc.pid, last_step(steps) + 1, 30)
            c = leave_running_cycle(img4, img1)
            rep, q, r, cin = c["rep"], c["q"], c["r"], c["cin"]
            record("fastincr", copy_out_ms=round(c["co"], 1),
                   copied_mib=rep.get("copied_bytes", 0) >> 20,
                   parent_chunks=rep.get("parent_chunks"), release_ms=round(c["rl"], 1),
                   driver_ms=round(q.get("lock", 0) + q.get("checkpoint", 0) + r.get("restore", 0)
                                   + r.get("unlock", 0), 1),
                   remap_ms=round(c["rm"], 1), copy_in_ms=round(c["ci"], 1),
                   copy_in_gbps=round(cin.get("bytes", 0) / c["ci"] / 1e6, 2),
                   pause_ms=round(c["total"], 1),
                   out_profile=rep.get("profile"), in_profile=cin.get("profile"),
                   mapped_reads=cin.get("mapped_reads"))
            shutil.rmtree(img4, ignore_errors=True)

        if "keep" in phases:
            img5 = os.path.join(a.tmpfs, f"img5-{label}")
            shutil.rmtree(img5, ignore_errors=True)
            wait_step(steps, proc.pid, last_step(steps) + 1, 30)
            record_keep("keep", leave_running_cycle(img5, None, keep=True))
            if "keepincr" in phases:
                img6 = os.path.join(a.tmpfs, f"img6-{label}")
                shutil.rmtree(img6, ignore_errors=True)
                wait_step(steps, proc.pid, last_step(steps) + 1, 30)
                record_keep("keepincr", leave_running_cycle(img6, img5, keep=True))
                shutil.rmtree(img6, ignore_errors=True)
            shutil.rmtree(img5, ignore_errors=True)

        if "snap" in phases:
            img7 = os.path.join(a.tmpfs, f"img7-{label}")
            shutil.rmtree(img7, ignore_errors=True)
            wait_step(steps, proc.pid, last_step(steps) + 1, 30)
            s = RssSampler(proc.pid)
            s.start()
            c = snapshot_cycle(img7, None)
            c["peak"] = s.done()
            record_snap("snap", c)
            gh1_check(img7, record)
            if os.path.isdir(img1):
                # The same static memory copied out while frozen (fast) and from the
                # snapshot: every static chunk must match.
                record("snap-vs-fast", **compare_images(img1, img7))
            if "snapincr" in phases:
                img8 = os.path.join(a.tmpfs, f"img8-{label}")
                shutil.rmtree(img8, ignore_errors=True)
                wait_step(steps, proc.pid, last_step(steps) + 1, 30)
                record_snap("snapincr", snapshot_cycle(img8, img7))
                shutil.rmtree(img8, ignore_errors=True)
            shutil.rmtree(img7, ignore_errors=True)

        if "same" in phases:
            img9 = os.path.join(a.tmpfs, f"img9-{label}")
            img10 = os.path.join(a.tmpfs, f"img10-{label}")
            for d in (img9, img10):
                shutil.rmtree(d, ignore_errors=True)
            wait_step(steps, proc.pid, last_step(steps) + 1, 30)
            h.call("Freeze")
            full, rep1 = h.call("CopyOut", image_dir=img9, parent=None)
            h.call("Thaw")
            h.call("Freeze")
            incr, rep2 = h.call("CopyOut", image_dir=img10, parent=img9)
            h.call("Thaw")
            record("same", full_ms=round(full, 1), incr_ms=round(incr, 1),
                   ratio=round(full / incr, 1), full_gbps=round(rep1.get("bytes", 0) / full / 1e6, 2),
                   copied_mib=rep2.get("copied_bytes", 0) >> 20,
                   parent_chunks=rep2.get("parent_chunks"), image_mib=du(img10) >> 20,
                   full_profile=rep1.get("profile"), incr_profile=rep2.get("profile"))
            for d in (img9, img10):
                shutil.rmtree(d, ignore_errors=True)

        if "prep" in phases:
            # Side by side in one process: a full copy-out staged as before, then the same
            # prepared (Prepare while the workload runs, then Freeze -> CopyOut), restored
            # from (Release -> Remap -> CopyIn); then incremental copy-outs against it,
            # prepared and staged.
            imgs = {k: os.path.join(a.tmpfs, f"img-{k}-{label}") for k in ("s", "p", "pi", "si")}
            for d in imgs.values():
                shutil.rmtree(d, ignore_errors=True)
            wait_step(steps, proc.pid, last_step(steps) + 1, 30)
            h.call("Freeze")
            staged, rep_s = h.call("CopyOut", image_dir=imgs["s"], parent=None)
            h.call("Thaw")
            shutil.rmtree(imgs["s"], ignore_errors=True)  # two full images may not fit
            wait_step(steps, proc.pid, last_step(steps) + 1, 30)
            prep, prep_rep = h.call("Prepare", image_dir=imgs["p"], parent=None)
            steps_prep = last_step(steps)
            fz, _ = h.call("Freeze")
            co, rep = h.call("CopyOut", image_dir=imgs["p"], parent=None)
            rl, _, _, _ = h.release(False)
            rm, _ = h.call("Remap")
            ci, cin = h.call("CopyIn", image_dir=imgs["p"])
            h.call("Thaw")
            nbytes = rep.get("bytes", 0)
            record("prep", prepare_ms=round(prep, 1), prepare=prep_rep,
                   copy_out_ms=round(co, 1), copy_out_gbps=round(nbytes / co / 1e6, 2),
                   staged_ms=round(staged, 1), staged_gbps=round(rep_s.get("bytes", 0) / staged / 1e6, 2),
                   ratio_staged_vs_prepared=round(staged / co, 2),
                   prepare_plus_copy_out_ms=round(prep + co, 1),
                   release_ms=round(rl, 1), remap_ms=round(rm, 1), copy_in_ms=round(ci, 1),
                   copy_in_gbps=round(cin.get("bytes", 0) / ci / 1e6, 2),
                   image_mib=du(imgs["p"]) >> 20, peak_staging_mib=rep.get("peak_staging_bytes", 0) >> 20,
                   out_profile=rep.get("profile"), staged_profile=rep_s.get("profile"),
                   in_profile=cin.get("profile"),
                   mapped_reads=cin.get("mapped_reads"), steps_during_prepare=steps_prep)
            gh1_check(imgs["p"], record)
            # Incremental against it: prepared (places only for what the GPU hash finds
            # changed at the Prepare) and staged, side by side.
            wait_step(steps, proc.pid, last_step(steps) + 1, 30)
            iprep, iprep_rep = h.call("Prepare", image_dir=imgs["pi"], parent=imgs["p"])
            h.call("Freeze")
            ico, irep = h.call("CopyOut", image_dir=imgs["pi"], parent=imgs["p"])
            h.call("Thaw")
            wait_step(steps, proc.pid, last_step(steps) + 1, 30)
            h.call("Freeze")
            sco, srep = h.call("CopyOut", image_dir=imgs["si"], parent=imgs["p"])
            h.call("Thaw")
            record("prepincr", prepare_ms=round(iprep, 1), prepare=iprep_rep,
                   copy_out_ms=round(ico, 1), staged_incr_ms=round(sco, 1),
                   full_prepared_ms=round(co, 1), full_staged_ms=round(staged, 1),
                   ratio_full_vs_incr_prepared=round(co / ico, 1),
                   ratio_full_staged_vs_incr_prepared=round(staged / ico, 1),
                   ratio_full_vs_incr_staged=round(staged / sco, 1),
                   copied_mib=irep.get("copied_bytes", 0) >> 20,
                   parent_chunks=irep.get("parent_chunks"), image_mib=du(imgs["pi"]) >> 20,
                   peak_staging_mib=irep.get("peak_staging_bytes", 0) >> 20,
                   out_profile=irep.get("profile"), staged_profile=srep.get("profile"))
            for d in imgs.values():
                shutil.rmtree(d, ignore_errors=True)

        if "disk" in phases:
            img_disk = os.path.join(a.disk, f"img-{label}")
            shutil.rmtree(img_disk, ignore_errors=True)
            subprocess.run(["sync"])
            fz, _ = h.call("Freeze")
            t0 = time.monotonic()
            co, rep = h.call("CopyOut", image_dir=img_disk, parent=None)
            subprocess.run(["sync", "-f", a.disk])
            synced = (time.monotonic() - t0) * 1000
            th, _ = h.call("Thaw")
            record("disk", copy_out_ms=round(co, 1), with_sync_ms=round(synced, 1),
                   disk_gbps=round(rep.get("bytes", 0) / synced / 1e6, 2), image_mib=du(img_disk) >> 20,
                   out_profile=rep.get("profile"))
            shutil.rmtree(img_disk, ignore_errors=True)

        if "incr" in phases and os.path.isdir(img1):
            img2 = os.path.join(a.tmpfs, f"img2-{label}")
            shutil.rmtree(img2, ignore_errors=True)
            fz, _ = h.call("Freeze")
            co, rep = h.call("CopyOut", image_dir=img2, parent=img1)
            th, _ = h.call("Thaw")
            record("incr", copy_out_ms=round(co, 1), image_mib=du(img2) >> 20,
                   full_image_mib=du(img1) >> 20, out_profile=rep.get("profile"),
                   copied_mib=rep.get("copied_bytes", 0) >> 20,
                   zero_chunks=rep.get("zero_chunks"), parent_chunks=rep.get("parent_chunks"))
            gh1_check(img2, record)
            if a.disk:
                img3 = os.path.join(a.disk, f"img3-{label}")
                shutil.rmtree(img3, ignore_errors=True)
                fz, _ = h.call("Freeze")
                t0 = time.monotonic()
                co, rep = h.call("CopyOut", image_dir=img3, parent=img1)
                subprocess.run(["sync", "-f", a.disk])
                synced = (time.monotonic() - t0) * 1000
                h.call("Thaw")
                record("incr-disk", copy_out_ms=round(co, 1), with_sync_ms=round(synced, 1),
                       image_mib=du(img3) >> 20)
                shutil.rmtree(img3, ignore_errors=True)
            shutil.rmtree(img2, ignore_errors=True)

        want = last_step(steps) + 3
        if not wait_step(steps, proc.pid, want, 60):
            ok_all = False
        now_line()
        ok, detail = e2e_helper.verdict(a.ref, steps)
        ok_all = ok_all and ok
        record("verify", ok=ok, detail=detail)
    except Exception as e:  # noqa: BLE001 - report and go on to the next size
        ok_all = False
        record("error", error=str(e)[:1500], stderr=open(errlog.name).read()[-1500:])
    finally:
        shutil.copy(steps, a.out + f".{label}.steps") if os.path.exists(steps) else None
        proc.kill()
        proc.wait()
        try:
            shutil.copy(errlog.name, a.out + f".{label}.stderr")
        except OSError:
            pass
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(os.path.join(a.tmpfs, f"img-{label}"), ignore_errors=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
