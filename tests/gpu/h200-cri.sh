#!/usr/bin/env bash
# kubelet's CRI calls with GPU pods on the H200 (issues #21, #28), in one call:
#
#   bash tests/gpu/h200-cri.sh          with carry/ from tests/gpu/prepare-carry.sh --cri
#
# containerd 2.x (Debian sid's, carried) with its CRI plugin and the `gpucr` runtime class
# exactly as install/install.sh writes it (its drop-in in /etc/containerd/conf.d, imported);
# gpucr installed by install.sh --from; pods on the host network (the GPU machine has no
# iptables for CRIU's network lock) with a kubepods-style cgroup parent; a loopback registry.
# For each scenario, tests/src/bin/cri-gpu.rs makes kubelet's calls: RunPodSandbox, PullImage,
# CreateContainer, StartContainer, CheckpointContainer to a kubelet-style archive (the
# container runs on), `checkpointctl inspect --all` of the archive, a new pod restored from the
# archive path and one from a checkpoint image (org.criu.checkpoint.container.name) pulled from
# the registry; with `ctr` legs, the same container through `ctr c checkpoint --task --rw` /
# `ctr c restore --live --rw` on the same containerd, side by side. Every step the workload
# writes must be the uninterrupted reference run's, without a gap or a restart.
#
# Scenarios (GPUCR_CRI_ONLY, default all):
#   llm-hook      an LLM server's greedy decode loop (llm_decode.py, GPUCR_CRI_LLM_GIB, default
#                 4 GiB of bf16 weights), the GPU from a CDI spec (cdi_devices, as kubelet passes
#                 a device plugin's CDI names), the hook path (default); a ctr leg
#   train-hook    the training loop with Adam (torch_train.py, GPUCR_CRI_TRAIN_GIB, default 2),
#                 the GPU's device nodes in ContainerConfig.devices; a ctr leg
#   llm-driver, train-driver   the same with io.gpucr.hook=off from the pod's annotations
#                 (the driver path), no ctr leg
# GPUCR_CRI_STORE=local|shared: checkpoints by reference (issue 22): containerd's environment
# gets GPUCR_STORE=$DATA/store (tmpfs) and GPUCR_STORE_MODE (shared: GPUCR_STORE_SHARED=
# $DATA/shared too), so kubelet's archive holds the reference, not the GPU bytes (archive_mib).
# GPUCR_CRI_DRY=1: no GPU (a CPU machine): the host's containerd 2.x (tests/containerd2.sh),
# runc and CRIU, a shell workload writing the same kind of steps, the drop-in file imported
# from the repo instead of installed; checks the flow and the script.
# Results in $OUT: cri-summary.txt, cri-results.txt, cri.log, containerd.log.gz, install.txt,
# the checkpointctl output.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
DRY=${GPUCR_CRI_DRY:-0}
OUT=${OUT:-$REPO/e2e-out}
mkdir -p "$OUT"
CARRY=${GPUCR_CRI_CARRY:-$REPO/carry}
ONLY=${GPUCR_CRI_ONLY:-llm-hook train-driver train-hook llm-driver}
LLM_GIB=${GPUCR_CRI_LLM_GIB:-4}
TRAIN_GIB=${GPUCR_CRI_TRAIN_GIB:-2}
START=$(date +%s)
if [ "$DRY" = 1 ]; then
  DATA=${GPUCR_CRI_DATA:-$(mktemp -d /tmp/gpucr-cri-dry.XXXXXX)}
else
  DATA=${GPUCR_CRI_DATA:-/dev/shm/gpucr-cri}
fi
TOOLS=$DATA/tools
BIN=$TOOLS/bin
mkdir -p "$DATA" "$BIN" "$DATA/tmp" "$DATA/cdi"
exec > >(tee -a "$OUT/cri.log") 2>&1

elapsed() { echo $(($(date +%s) - START)); }
log() { echo "[$(elapsed)s] $*"; }
die() { log "FATAL: $*"; exit 1; }

cleanup() {
  local rc=$?
  set +e
  trap - EXIT
  # cri-gpu removes its pods and stops its containerd; anything a crash left: shims of our
  # daemon, their containers' cgroups, mounts under $DATA.
  local p
  for p in $(pgrep -f "containerd-shim-.*-address $DATA" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  awk -v d="$DATA" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
  [ -f "$OUT/containerd.log" ] && gzip -f "$OUT/containerd.log"
  {
    echo "gpucr kubelet CRI flow on the GPU, $(date -u +%FT%TZ), $(elapsed)s, dry=$DRY"
    echo "host: $(uname -r); driver: $(head -1 /proc/driver/nvidia/version 2>/dev/null | sed 's/  */ /g')"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
    cat "$OUT/versions.txt" 2>/dev/null
    echo
    cat "$OUT/cri-results.txt" 2>/dev/null
    echo
    echo "PASS $(grep -c ' PASS ' "$OUT/cri-results.txt" 2>/dev/null) FAIL $(grep -c ' FAIL ' "$OUT/cri-results.txt" 2>/dev/null)"
  } >"$OUT/cri-summary.txt"
  cat "$OUT/cri-summary.txt"
  if [ "$DRY" = 1 ] && [ -z "${GPUCR_CRI_DATA:-}" ]; then rm -rf "$DATA"; fi
  exit "$rc"
}
trap cleanup EXIT

want() { case " $ONLY " in *" $1 "*) return 0 ;; esac; return 1; }

# ---------------------------------------------------------------- dependencies and install
CONTAINERD2=""
CHECKPOINTCTL=""
if [ "$DRY" = 1 ]; then
  CONTAINERD2=${GPUCR_TEST_CONTAINERD2:-/opt/gpucr-test/containerd2/usr/bin/containerd}
  CHECKPOINTCTL=${GPUCR_CHECKPOINTCTL:-/opt/gpucr-test/bin/checkpointctl}
  [ -x "$CONTAINERD2" ] || die "no containerd 2.x at $CONTAINERD2 (tests/containerd2.sh)"
  ln -sf "$(command -v busybox)" "$BIN/busybox"
  cp "${GPUCR_CRI_BIN:-$REPO/target/release/cri-gpu}" "$BIN/cri-gpu"
  # The drop-in install.sh writes for containerd 2.x, from the repo (the node keeps its own).
  mkdir -p "$DATA/conf.d"
  cp install/containerd/gpucr-v3.toml "$DATA/conf.d/gpucr.toml"
  IMPORTS="$DATA/conf.d/*.toml"
else
  [ -d "$CARRY/debs" ] || die "$CARRY/debs missing: run tests/gpu/prepare-carry.sh --cri here and carry 'carry'"
  log "extracting $(ls "$CARRY"/debs/*.deb | wc -l) .debs into $TOOLS/root"
  for f in "$CARRY"/debs/*.deb; do dpkg -x "$f" "$TOOLS/root"; done
  r=$TOOLS/root
  [ -x "$r/usr/sbin/criu" ] || die "criu not found in the extracted packages"
  cat >"$BIN/criu" <<EOF
#!/bin/sh
# CRIU from Debian packages extracted into $r; runc runs it from PATH.
export LD_LIBRARY_PATH="$r/usr/lib/x86_64-linux-gnu:$r/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$r/usr/sbin/criu" "\$@"
EOF
  chmod +x "$BIN/criu"
  for b in containerd ctr containerd-shim-runc-v2; do ln -sf "$r/usr/bin/$b" "$BIN/$b"; done
  ln -sf "$(ls "$r"/usr/sbin/runc "$r"/usr/bin/runc 2>/dev/null | head -1)" "$BIN/runc"
  ln -sf "$(ls "$r"/bin/busybox "$r"/usr/bin/busybox 2>/dev/null | head -1)" "$BIN/busybox"
  CONTAINERD2=$r/usr/bin/containerd
  [ -x "$r/usr/bin/checkpointctl" ] && CHECKPOINTCTL=$r/usr/bin/checkpointctl
  "$CONTAINERD2" --version | grep -q ' 2\.' || die "the carried containerd is not 2.x: $("$CONTAINERD2" --version)"
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$CARRY/bin/cri-gpu.xz" "$BIN/cri-gpu"
  chmod 0755 "$BIN/cri-gpu"
  # The product where install.sh puts it, by install.sh (prebuilt files: no cargo here).
  stage=$TOOLS/product
  mkdir -p "$stage"
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$CARRY/bin/containerd-shim-gpucr-v2.xz" "$stage/containerd-shim-gpucr-v2"
  for b in libgpucr_criu_plugin.so libgpucr_hook.so gpucr-copyin; do cp "$CARRY/bin/$b" "$stage/"; done
  chmod 0755 "$stage/containerd-shim-gpucr-v2" "$stage/gpucr-copyin"
  PATH="$BIN:$PATH" bash install/install.sh --no-deps --from "$stage" >"$OUT/install.txt" 2>&1 \
    || { cat "$OUT/install.txt"; die "install/install.sh failed"; }
  log "installed (install.txt): $(tail -3 "$OUT/install.txt" | head -1)"
  cp /etc/containerd/config.toml "$OUT/etc-containerd-config.toml"
  cp /etc/containerd/conf.d/gpucr.toml "$OUT/etc-containerd-conf.d-gpucr.toml"
  IMPORTS="/etc/containerd/conf.d/*.toml"
fi
chmod 0755 "$BIN/cri-gpu"
export PATH="$BIN:$PATH"
{
  echo "containerd: $("$CONTAINERD2" --version)"
  echo "runc: $(runc --version | head -1)"
  echo "criu: $(criu --version | head -1)"
  echo "shim: $(sha256sum "${GPUCR_SHIM_DIR:-/usr/local/bin}/containerd-shim-gpucr-v2" | cut -c1-12)"
  echo "checkpointctl: ${CHECKPOINTCTL:-none}"
} | tee "$OUT/versions.txt"

# ---------------------------------------------------------------- images and references
# One-layer image (an uncompressed tar of ROOTFS) for the registry cri-gpu serves.
layer_of() { tar --sort=name --owner=0 --group=0 --numeric-owner -C "$1" -cf "$2" .; }

MOUNTS_JSON="[]"
ENV_JSON="{}"
GPU_DEVICES=()
if [ "$DRY" = 1 ]; then
  r=$DATA/rootfs
  mkdir -p "$r/bin" "$r/tmp" "$r/proc" "$r/sys" "$r/dev" "$r/etc"
  chmod 1777 "$r/tmp"
  cp "$(readlink -f "$BIN/busybox")" "$r/bin/busybox"
  for a in $("$r/bin/busybox" --list); do [ "$a" = busybox ] || ln -sf busybox "$r/bin/$a"; done
  echo 'root:x:0:0:root:/:/bin/sh' >"$r/etc/passwd"
  # The CPU stand-in for a GPU workload: the same kind of steps, from a shell loop.
  cat >"$r/steps.sh" <<'SH'
i=0
while :; do printf 'step %d hash %016x\n' "$i" $((i * 7919)) >>/tmp/steps; i=$((i + 1)); sleep 0.3; done
SH
  layer_of "$r" "$DATA/layer.tar"
  i=0; while [ $i -le 400 ]; do printf 'step %d hash %016x\n' $i $((i * 7919)); i=$((i + 1)); done >"$DATA/ref-cpu.txt"
else
  GPU_UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
  nodes=""
  for dev in /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools; do
    [ -e "$dev" ] && { nodes+="${nodes:+,}{\"path\": \"$dev\"}"; GPU_DEVICES+=("$dev"); }
  done
  # The spec a device plugin's CDI mode writes: the nodes, the driver, the GPU's UUID.
  driver_mount=""
  [ -d /usr/local/nvidia ] && driver_mount=', "mounts": [{"hostPath": "/usr/local/nvidia", "containerPath": "/usr/local/nvidia", "options": ["ro", "rbind"]}]'
  cat >"$DATA/cdi/nvidia.json" <<EOF
{"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu",
 "devices": [{"name": "0", "containerEdits": {
   "env": ["NVIDIA_VISIBLE_DEVICES=$GPU_UUID"],
   "deviceNodes": [$nodes]$driver_mount}}]}
EOF
  log "GPU $GPU_UUID; devices ${GPU_DEVICES[*]}; driver dir: $(ls -d /usr/local/nvidia 2>/dev/null || echo none)"
  cp "$DATA/cdi/nvidia.json" "$OUT/cdi-nvidia.json"
  # The PyTorch image: mount points for the host's python and torch, bound read-only.
  info=$(python3 -c 'import os, sys, torch; print(os.path.dirname(torch.__file__)); print(sys.prefix); print(sys.base_prefix); print(os.path.realpath(sys.executable)); print(sys.executable)') \
    || die "python3 cannot import torch on this host"
  TORCH_PY=$(echo "$info" | sed -n 5p)
  r=$DATA/rootfs
  mkdir -p "$r/tmp" "$r/proc" "$r/sys" "$r/dev" "$r/etc" "$r/usr" "$r/usr/local/nvidia"
  chmod 1777 "$r/tmp"
  echo 'root:x:0:0:root:/root:/bin/sh' >"$r/etc/passwd"
  echo 'root:x:0:' >"$r/etc/group"
  cp /etc/ld.so.cache "$r/etc/ld.so.cache" 2>/dev/null || true
  cp tests/gpu/llm_decode.py tests/gpu/torch_train.py "$r/"
  binds=(/usr)
  for d in bin sbin lib lib64 lib32 libx32; do
    if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$r/$d"; elif [ -d "/$d" ]; then binds+=("/$d"); fi
  done
  while read -r p; do
    [ -n "$p" ] || continue
    top=$(findmnt -n -o TARGET --target "$p" 2>/dev/null || echo /)
    [ "$top" = / ] && top=/$(echo "$p" | cut -d/ -f2)
    case " ${binds[*]} " in *" $top "*) continue ;; esac
    case $top in /usr/*|/proc|/sys|/dev|/tmp|/) continue ;; esac
    binds+=("$top")
  done <<<"$info"
  for d in "${binds[@]}"; do mkdir -p "$r$d"; done
  layer_of "$r" "$DATA/layer.tar"
  MOUNTS_JSON=$(python3 -c 'import json, sys; print(json.dumps([[d, d] for d in sys.argv[1:]]))' "${binds[@]}")
  ENV_JSON=$(python3 -c 'import json, sys; print(json.dumps({"LD_LIBRARY_PATH": sys.argv[1], "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp", "PYTHONUNBUFFERED": "1"}))' \
    "/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
  log "torch image: python $TORCH_PY; binds ${binds[*]}"
  if want llm-hook || want llm-driver; then
    t0=$(date +%s%N)
    timeout 300 "$TORCH_PY" tests/gpu/llm_decode.py "$LLM_GIB" 400 0 "$DATA/ref-llm.txt" >/dev/null
    log "reference llm ${LLM_GIB} GiB: $(wc -l <"$DATA/ref-llm.txt") lines in $((($(date +%s%N) - t0) / 1000000)) ms"
  fi
  if want train-hook || want train-driver; then
    t0=$(date +%s%N)
    timeout 300 "$TORCH_PY" tests/gpu/torch_train.py "$TRAIN_GIB" 400 0 "$DATA/ref-train.txt" >/dev/null
    log "reference train ${TRAIN_GIB} GiB: $(wc -l <"$DATA/ref-train.txt") lines in $((($(date +%s%N) - t0) / 1000000)) ms"
  fi
  cp "$DATA"/ref-*.txt "$OUT/" 2>/dev/null || true
fi

# ---------------------------------------------------------------- the plan
CTR_GPU_JSON=$(python3 -c 'import json, sys; a = []
for d in sys.argv[1:]: a += ["--device", d]
import os
if os.path.isdir("/usr/local/nvidia"): a += ["--mount", "type=bind,src=/usr/local/nvidia,dst=/usr/local/nvidia,options=rbind:ro"]
print(json.dumps(a))' "${GPU_DEVICES[@]}")
DEVICES_JSON=$(python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "${GPU_DEVICES[@]}")
STORE_MODE=${GPUCR_CRI_STORE:-}
if [ -n "$STORE_MODE" ]; then
  rm -rf "$DATA/store" "$DATA/shared"
  mkdir -p "$DATA/shared"
  log "checkpoints by reference: mode $STORE_MODE, store $DATA/store"
fi
python3 - "$DATA/plan.json" <<EOF
import json, os, sys
dry = "$DRY" == "1"
store_env = {}
if "$STORE_MODE":
    store_env = {"GPUCR_STORE": "$DATA/store", "GPUCR_STORE_MODE": "$STORE_MODE"}
    if "$STORE_MODE" == "shared":
        store_env["GPUCR_STORE_SHARED"] = "$DATA/shared"
only = "$ONLY".split()
scenarios = []
def add(name, **kw):
    if name in only:
        scenarios.append(dict(name=name, handler="gpucr", image="gpucr/workload:1",
                              steps_file="/tmp/steps", start_timeout_s=240, **kw))
if dry:
    # No GPU: the hook is forced on (io.gpucr.hook=on) or off through the pod's annotations,
    # which reach the shim only through the drop-in's container_annotations.
    for name, hook in (("llm-hook", "on"), ("train-hook", "on"), ("llm-driver", "off"),
                       ("train-driver", "off")):
        add(name, command=["sh", "/steps.sh"], reference="$DATA/ref-cpu.txt",
            annotations={"io.gpucr.hook": hook}, expect_hook=hook == "on",
            ctr=[] if hook == "on" else None)
else:
    mounts, env = json.loads('''$MOUNTS_JSON'''), json.loads('''$ENV_JSON''')
    ctr_gpu, devices = json.loads('''$CTR_GPU_JSON'''), json.loads('''$DEVICES_JSON''')
    llm = ["${TORCH_PY:-python3}", "/llm_decode.py", "$LLM_GIB", "0", "500", "/tmp/steps"]
    train = ["${TORCH_PY:-python3}", "/torch_train.py", "$TRAIN_GIB", "0", "500", "/tmp/steps"]
    add("llm-hook", command=llm, reference="$DATA/ref-llm.txt", mounts=mounts, env=env,
        cdi_devices=["nvidia.com/gpu=0"], ctr=ctr_gpu, expect_hook=True)
    # Device nodes alone (a device plugin's AllocateResponse): the driver directory is its
    # own mount then too (the plugin's Mounts), not a submount of the /usr bind, which CRIU
    # cannot dump (squashfs there).
    if os.path.isdir("/usr/local/nvidia"):
        dev_mounts = mounts + [["/usr/local/nvidia", "/usr/local/nvidia"]]
    else:
        dev_mounts = mounts
    add("train-driver", command=train, reference="$DATA/ref-train.txt", mounts=dev_mounts, env=env,
        devices=devices, annotations={"io.gpucr.hook": "off"}, expect_hook=False)
    add("train-hook", command=train, reference="$DATA/ref-train.txt", mounts=dev_mounts, env=env,
        devices=devices, ctr=[a for d in devices for a in ("--device", d)], expect_hook=True)
    add("llm-driver", command=llm, reference="$DATA/ref-llm.txt", mounts=mounts, env=env,
        cdi_devices=["nvidia.com/gpu=0"], annotations={"io.gpucr.hook": "off"}, expect_hook=False)
for s in scenarios:
    if s.get("ctr") is None:
        s.pop("ctr", None)
plan = {
    "out": "$OUT",
    "imports": ["$IMPORTS"],
    "cdi_spec_dirs": [] if dry else ["$DATA/cdi"],
    "env": dict(store_env, **({} if dry else {"GPUCR_CDI_SPEC_DIRS": "$DATA/cdi"})),
    "checkpointctl": "$CHECKPOINTCTL" or None,
    "images": [{"name": "gpucr/workload", "tag": "1", "layer": "$DATA/layer.tar",
                "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}],
    "scenarios": scenarios,
}
json.dump(plan, open(sys.argv[1], "w"), indent=1)
EOF
cp "$DATA/plan.json" "$OUT/cri-plan.json"
log "plan: $(python3 -c 'import json,sys; print(" ".join(s["name"] for s in json.load(open(sys.argv[1]))["scenarios"]))' "$DATA/plan.json")"

# ---------------------------------------------------------------- the flow
# Its containerd's root, state and TMPDIR under $DATA (tmpfs on the GPU machine: the restore's
# copy-in helpers read the unpacked checkpoint there).
set +e
TMPDIR=$DATA/tmp GPUCR_TEST_CONTAINERD2=$CONTAINERD2 GPUCR_BUSYBOX=$BIN/busybox \
  timeout -k 10 "${GPUCR_CRI_TIMEOUT_S:-560}" "$BIN/cri-gpu" "$DATA/plan.json"
status=$?
set -e
log "cri-gpu exited with $status"
exit "$status"
