"""Helpers for tests/gpu/h200-e2e.sh (python3 standard library only).

  check REF FILE                 compare a workload's lines with an uninterrupted reference run
  laststep FILE                  the last step number in FILE (-1 if none)
  splice BEFORE AFTER OUT        steps of BEFORE up to AFTER's first step, then AFTER (a restore
                                 without the rw layer starts a fresh steps file)
  repack CONTENT_DIR INDEX RUNTIME SNAPSHOTTER RW > layout.tar
                                 turn a `ctr task checkpoint` index into a checkpoint image that
                                 `ctr container restore` (containerd 1.7) reads
  image-files CONTENT_DIR INDEX OUTDIR NAME...
                                 copy NAME... out of a checkpoint image's CRIU tar
  shimlog LOG ID                 the gpucr shim's timing lines for container ID, as key=value
  gpujson FILE                   per-process step timings of a gpucr-gpu.json, as key=value
"""
import hashlib
import io
import json
import os
import re
import sys
import tarfile

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CRIU_TAR = "application/vnd.containerd.container.criu.checkpoint.criu.tar"
MEDIA_SPEC = "application/vnd.containerd.container.checkpoint.config.v1+proto"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LINE = re.compile(r"^(step|now|static) (\d+) hash ([0-9a-f]+)$")


def read_lines(path):
    out = []
    with open(path) as f:
        for raw in f:
            m = LINE.match(raw.strip())
            if m:
                out.append((m.group(1), int(m.group(2)), m.group(3)))
    return out


def verdict(ref_path, path):
    """Every step must come once, in order from 0, with the reference's hash; every "now S"
    must equal the reference's step S; every "static" line (a buffer that never changes) the
    first one. Returns (ok, one summary line)."""
    ref = {s: h for kind, s, h in read_lines(ref_path) if kind == "step"}
    got = read_lines(path)
    errors = []
    expect = 0
    steps = nows = 0
    statics = {h for kind, _, h in got if kind == "static"}
    if len(statics) > 1:
        errors.append(f"the static buffer changed: {len(statics)} different hashes")
    for kind, s, h in got:
        if kind == "static":
            continue
        if s not in ref:
            errors.append(f"{kind} {s}: beyond the reference ({len(ref)} steps)")
            continue
        if ref[s] != h:
            errors.append(f"{kind} {s}: hash {h}, reference {ref[s]}")
        if kind == "step":
            steps += 1
            if s != expect:
                errors.append(f"step {s} follows step {expect - 1} (gap or repeat)")
            expect = s + 1
        else:
            nows += 1
    if not got:
        errors.append("no lines")
    elif not steps:
        errors.append("no step lines")
    last = expect - 1
    if errors:
        return False, f"MISMATCH steps={steps} now={nows} last={last}: " + "; ".join(errors[:5])
    return True, f"ok steps={steps} now={nows} last={last}"


def check(ref_path, path):
    """verdict() as a command: prints its line; exit 1 on a mismatch."""
    ok, line = verdict(ref_path, path)
    print(line)
    if not ok:
        sys.exit(1)


def splice(before, after, out):
    """A restore without the rootfs (no rw layer): the restored process writes its steps
    into a fresh file. BEFORE (the steps file at the kill) up to the first step AFTER has,
    then AFTER, into OUT: the sequence the restored process continued."""
    later = [s for kind, s, _ in read_lines(after) if kind == "step"]
    first = later[0] if later else None
    lines = []
    with open(before) as f:
        for raw in f:
            m = LINE.match(raw.strip())
            if m and m.group(1) == "step" and first is not None and int(m.group(2)) >= first:
                break
            lines.append(raw)
    with open(after) as f:
        lines.extend(f.readlines())
    with open(out, "w") as f:
        f.writelines(lines)


def laststep(path):
    try:
        steps = [s for kind, s, _ in read_lines(path) if kind == "step"]
    except OSError:
        steps = []
    print(steps[-1] if steps else -1)


def blob_path(content_dir, digest):
    algo, hexd = digest.split(":", 1)
    return os.path.join(content_dir, "blobs", algo, hexd)


def load_index(content_dir, index_digest):
    with open(blob_path(content_dir, index_digest)) as f:
        return json.load(f)


def repack(content_dir, index_digest, runtime, snapshotter, rw):
    index = load_index(content_dir, index_digest)
    image = (index.get("annotations") or {}).get("image.name")
    if not image:
        sys.exit(f"repack: index {index_digest} has no image.name annotation")
    by_type = {d["mediaType"]: d for d in index.get("manifests", [])}
    wanted = ([MEDIA_LAYER_GZIP] if rw == "1" else []) + [MEDIA_CRIU_TAR, MEDIA_SPEC]
    children = []
    for mt in wanted:
        d = by_type.get(mt)
        if d is None:
            if mt == MEDIA_LAYER_GZIP:
                continue
            sys.exit(f"repack: index {index_digest} has no {mt}")
        children.append({"mediaType": mt, "digest": d["digest"], "size": d["size"],
                         "platform": {"architecture": "amd64", "os": "linux"}})
    new_index = json.dumps({
        "schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": children,
        "annotations": {
            "io.containerd.checkpoint.runtime": runtime,
            "io.containerd.checkpoint.snapshotter": snapshotter,
            "org.opencontainers.image.ref.name": image,
        }}).encode()
    new_digest = "sha256:" + hashlib.sha256(new_index).hexdigest()
    ref = os.environ.get("REPACK_REF", "docker.io/gpucr/repacked:1")
    top = json.dumps({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [{
        "mediaType": MEDIA_INDEX, "digest": new_digest, "size": len(new_index),
        "annotations": {"org.opencontainers.image.ref.name": ref}}]}).encode()
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
        def add_bytes(name, data):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
        add_bytes("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add_bytes("index.json", top)
        add_bytes("blobs/sha256/" + new_digest.split(":")[1], new_index)
        for c in children:
            p = blob_path(content_dir, c["digest"])
            ti = tarfile.TarInfo("blobs/sha256/" + c["digest"].split(":")[1])
            ti.size = os.path.getsize(p)
            with open(p, "rb") as f:
                tar.addfile(ti, f)


def image_files(content_dir, index_digest, outdir, names):
    index = load_index(content_dir, index_digest)
    tars = [d for d in index.get("manifests", []) if d["mediaType"] == MEDIA_CRIU_TAR]
    if not tars:
        sys.exit(f"image-files: index {index_digest} has no CRIU tar")
    left = set(names)
    os.makedirs(outdir, exist_ok=True)
    # Stream: the small JSON files sort before the page images, so this stops early.
    with open(blob_path(content_dir, tars[0]["digest"]), "rb") as f, \
            tarfile.open(fileobj=f, mode="r|") as tar:
        for m in tar:
            base = os.path.basename(m.name)
            if base in left and m.isfile():
                with tar.extractfile(m) as src, open(os.path.join(outdir, base), "wb") as dst:
                    dst.write(src.read())
                left.discard(base)
                if not left:
                    break
    for n in sorted(left):
        print(f"image-files: {n} not in the checkpoint image", file=sys.stderr)
    sys.exit(1 if len(left) == len(set(names)) else 0)


def shimlog(log, cid):
    """Timing fields of the gpucr shim's lines for one container, last value of each wins:
    gpu_quiesce_ms ("GPU locked and checkpointed"), dump_ms ("checkpointed"),
    restore_ms ("restored", runc restore + GPU restore), gpu_restored (process count),
    and the hook's: gpu_paused_ms (freeze to thaw), snapshot_reattach_ms, snapshot_write_ms,
    and its copy-in's (a restore): hook_copy_in_ms, copy_in_gb_s, helpers, helper_bytes,
    helper_pin_wait_ms, helpers_failed."""
    found = {}
    pat_id = re.compile(r'\bid="?' + re.escape(cid) + r'"?(\s|$)')
    with open(log, errors="replace") as f:
        for line in f:
            if not pat_id.search(line):
                continue
            def field(name):
                m = re.search(r"\b" + name + r"=(\d+)", line)
                return m.group(1) if m else None
            if "GPU locked and checkpointed" in line and field("elapsed_ms"):
                found["gpu_quiesce_ms"] = field("elapsed_ms")
            elif "GPU state restored" in line and field("processes"):
                found["gpu_restored"] = field("processes")
            elif re.search(r"\bcheckpointed\b", line) and field("dump_ms"):
                found["dump_ms"] = field("dump_ms")
            elif re.search(r"\brestored\b", line) and field("elapsed_ms"):
                found["restore_ms"] = field("elapsed_ms")
            elif "snapshot written while the process runs" in line and field("write_ms"):
                found["snapshot_write_ms"] = field("write_ms")
            elif "from its snapshot on the GPU" in line and field("reattach_ms"):
                found["snapshot_reattach_ms"] = field("reattach_ms")
            elif "GPU work resumed by the hook" in line and field("gpu_paused_ms"):
                found["gpu_paused_ms"] = field("gpu_paused_ms")
            elif "device memory given back by the hook" in line and field("hook_copy_in_ms"):
                for name in ("hook_copy_in_ms", "helpers", "helper_bytes",
                             "helper_pin_wait_ms", "helpers_failed"):
                    if field(name):
                        found[name] = field(name)
                m = re.search(r'\bcopy_in_gb_s="?([\d.]+)', line)
                if m:
                    found["copy_in_gb_s"] = m.group(1)
    print(" ".join(f"{k}={v}" for k, v in sorted(found.items())))


def gpujson(path):
    with open(path) as f:
        rec = json.load(f)
    parts = []
    for p in rec.get("processes", []):
        pid = p.get("pid")
        for st in p.get("steps", []):
            name = str(st.get("step", "?")).lower()
            parts.append(f"pid{pid}_{name}_ms={float(st.get('duration_ms', 0)):.1f}")
        b, a = p.get("rss_before_checkpoint_kib"), p.get("rss_after_checkpoint_kib")
        if b is not None and a is not None:
            parts.append(f"pid{pid}_rss_growth_mib={(a - b) // 1024}")
    print(" ".join(parts))


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "check" and len(args) == 2:
        check(*args)
    elif cmd == "splice" and len(args) == 3:
        splice(*args)
    elif cmd == "laststep" and len(args) == 1:
        laststep(*args)
    elif cmd == "repack" and len(args) == 5:
        repack(*args)
    elif cmd == "image-files" and len(args) >= 4:
        image_files(args[0], args[1], args[2], args[3:])
    elif cmd == "shimlog" and len(args) == 2:
        shimlog(*args)
    elif cmd == "gpujson" and len(args) == 1:
        gpujson(*args)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
