#!/usr/bin/env bash
# gpucr GPU end-to-end on the H200 machine, in one call (nothing can be downloaded there).
#
#   bash tests/gpu/h200-e2e.sh          with carry/ from tests/gpu/prepare-carry.sh
#
# Scenarios (one line each in $OUT/results.txt, PASS/FAIL and figures in $OUT/summary.txt):
#   a         stock io.containerd.runc.v2: `ctr task checkpoint` of a CUDA container fails, the
#             task keeps running
#   stock-N   stock runc shim + CRIU with the driver driven by hand (drive.c): lock+checkpoint,
#             `ctr c checkpoint --task --rw`, kill, rm, `ctr c restore --live --rw`,
#             restore+unlock; N GiB of device memory
#   b         gpucr: `ctr task checkpoint` (leaves the task running) and the workload goes on;
#   b-restore   then a restore of that checkpoint (repackaged as ctr 1.7 needs)
#   s         gpucr with the hook (GPUCR_E2E_HOOK=1): the shim's Checkpoint over ttrpc with no
#             Pause (shim-ckpt), so the hook snapshots on the GPU and the task runs on while the
#             image is written; s-restore: kill, `ctr c restore --live` of that directory
#   x         as s with exit: the task is not paused, so the shim prepares the hook's copy-out
#             (data file registered while it runs); x-restore as s-restore
#   c         gpucr: `ctr c checkpoint --task --rw`, kill, rm, `ctr c restore --live --rw`
#   d         gpucr with a PyTorch workload (host's python and torch bind-mounted read-only)
#   t         gpucr with a PyTorch training loop (torch_train.py): the same loss sequence
#   full      c onto a GPU whose memory a host process holds: the restore is refused when the
#             task is created, nothing is left, and it restores once the memory is free
#   e         stock runc shim + CRIU with gpucr's installed CRIU plugin (plain runc's path)
#   twice-N   the installed layout, default annotations, N GiB: c, then c again of the restored
#             container (twice-N-2); plugin-twice(-2) the same at SMALL GiB with
#             io.gpucr.gpu-quiesce=plugin
#   llm       an LLM server's greedy decode loop (llm_decode.py, 8 GiB bf16), two cycles (llm-2):
#             every token the uninterrupted run's; train-twice(-2) the training loop with Adam
#             (4 GiB), two cycles, every loss bit-identical
#   hang      CRIU never returns: the checkpoint fails at its 20 s deadline, the task runs on
#             with its GPU; hang-after: c of that container
#   gpucr-16  c with 16 GiB (f: benchmark); stock-16 likewise; gpucr-16-h0 as gpucr-16 with
#             the restore's copy-in helpers off (annotation io.gpucr.restore-helpers=0), side by
#             side (the helpers need the restore's image on tmpfs: GPUCR_E2E_TMPDIR)
# Every workload line "step S hash H" is compared with an uninterrupted reference run of the
# same program on the host: after a restore the steps go on from where they were, with the
# same hashes of device memory.
#
# Environment:
#   OUT                    where results go (the device tool sets it; default ./e2e-out)
#   GPUCR_E2E_DRY=1        no GPU: dependencies, containerd, images, and CPU-only checkpoint/
#                          restore cycles (busybox loop) through both runtimes; for CPU machines
#   GPUCR_E2E_SKIP_STOCK=1 skip a and stock-N (the stock runtime's small runs)
#   GPUCR_E2E_HOOK=0       gpucr containers get io.gpucr.hook=off (the driver path); by default
#                          the installed hook is injected into every GPU container (fast path)
# The product is installed by install/install.sh --from (prebuilt files from carry/bin) where
# it installs it: the shim in /usr/local/bin, gpucr's CRIU plugin in /usr/lib/criu, the hook in
# /usr/lib/gpucr. The stock baselines (a, stock-N) point CRIU at an empty plugin directory:
# they stand for a node without gpucr.
#   GPUCR_E2E_ONLY="c d"   run only these scenarios (names as in results.txt; default all)
#   GPUCR_E2E_SKIP_BIG=1   skip the 16 GiB runs;  GPUCR_E2E_BIG_GIB (16), GPUCR_E2E_SMALL_GIB (2)
#   GPUCR_E2E_BUDGET_S     seconds for the whole run (default 540); later parts are skipped
#                          when too little is left. A watchdog ends the run at budget + 30 s.
#   GPUCR_E2E_CARRY        carry folder (default <repo>/carry)
#   GPUCR_E2E_TOOLS        where dependencies are extracted (default /opt/gpucr-deps)
#   GPUCR_E2E_DATA         containerd root/state and checkpoints (default /dev/shm/gpucr-e2e
#                          when /dev/shm has 100 GiB free, else /var/tmp/gpucr-e2e-data)
#   GPUCR_E2E_TMPDIR       containerd's TMPDIR, where `ctr c restore` unpacks the checkpoint
#                          the shim restores from (default $DATA/tmp); on tmpfs the shim's
#                          copy-in helpers DMA straight from it
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
DRY=${GPUCR_E2E_DRY:-0}
OUT=${OUT:-$REPO/e2e-out}
mkdir -p "$OUT"
CARRY=${GPUCR_E2E_CARRY:-$REPO/carry}
BUDGET=${GPUCR_E2E_BUDGET_S:-540}
SMALL=${GPUCR_E2E_SMALL_GIB:-2}
BIG=${GPUCR_E2E_BIG_GIB:-16}
SKIP_BIG=${GPUCR_E2E_SKIP_BIG:-0}
HELPER="python3 $REPO/tests/gpu/e2e_helper.py"
START=$(date +%s)
NS=gpucr-e2e
RUNC_RT=io.containerd.runc.v2
GPUCR_RT=io.containerd.gpucr.v2

if [ "$DRY" = 1 ]; then
  scratch=$(mktemp -d /tmp/gpucr-e2e-dry.XXXXXX)
  TOOLS=${GPUCR_E2E_TOOLS:-$scratch/tools}
  DATA=${GPUCR_E2E_DATA:-$scratch/data}
else
  TOOLS=${GPUCR_E2E_TOOLS:-/opt/gpucr-deps}
  shm_free_gib=$(df -P -BG /dev/shm 2>/dev/null | awk 'NR==2 {sub("G","",$4); print $4}')
  if [ -z "${GPUCR_E2E_DATA:-}" ] && [ "${shm_free_gib:-0}" -ge 100 ] 2>/dev/null; then
    DATA=/dev/shm/gpucr-e2e
  else
    DATA=${GPUCR_E2E_DATA:-/var/tmp/gpucr-e2e-data}
  fi
fi
BIN=$TOOLS/bin
LOGS=$DATA/logs
SOCK=$DATA/containerd.sock
CTD_LOG=$DATA/containerd.log
CTD_TMP=${GPUCR_E2E_TMPDIR:-$DATA/tmp}
CONTENT=$DATA/root/io.containerd.content.v1.content
CTD_PID=""
RESULTS=$OUT/results.txt
: >"$RESULTS"

exec > >(tee -a "$OUT/e2e.log") 2>&1
TEE_PID=$!

elapsed() { echo $(($(date +%s) - START)); }
log() { echo "[$(elapsed)s] $*"; }
die() { log "FATAL: $*"; exit 1; }
now_ms() { date +%s%3N; }
# secs_since T0_MS -> seconds with 2 decimals
secs_since() { local d=$(($(now_ms) - $1)); printf '%d.%02d' $((d / 1000)) $((d % 1000 / 10)); }
left() { echo $((BUDGET - $(elapsed))); }

# result NAME PASS|FAIL|SKIP SECONDS DETAIL...
result() {
  local name=$1 status=$2 secs=$3
  shift 3
  printf '%-10s %-4s %7ss  %s\n' "$name" "$status" "$secs" "$*" | tee -a "$RESULTS"
}

# ctr with a timeout on every call: CTR_T=seconds (default 120).
cc() { timeout -k 5 "${CTR_T:-120}" ctr -a "$SOCK" -n "$NS" "$@"; }

# ---------------------------------------------------------------- cleanup and watchdog
# shellcheck disable=SC2317 # run by the EXIT trap
cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  [ -n "${WATCHDOG:-}" ] && kill "$WATCHDOG" 2>/dev/null
  log "cleanup (exit status $rc)"
  if [ -n "$CTD_PID" ] && kill -0 "$CTD_PID" 2>/dev/null; then
    for id in $(CTR_T=10 cc task ls -q 2>/dev/null); do CTR_T=10 cc task kill -a -s SIGKILL "$id" >/dev/null 2>&1; done
    sleep 1
    for id in $(CTR_T=10 cc task ls -q 2>/dev/null); do CTR_T=10 cc task rm -f "$id" >/dev/null 2>&1; done
    for id in $(CTR_T=10 cc c ls -q 2>/dev/null); do CTR_T=10 cc c rm "$id" >/dev/null 2>&1; done
    kill -TERM "$CTD_PID" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$CTD_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$CTD_PID" 2>/dev/null
    wait "$CTD_PID" 2>/dev/null
  fi
  # Shims of this daemon (they outlive it by design), found by our socket address.
  local p
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    if { tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null | grep -qF -- "-address $SOCK "; then
      kill -KILL "$p" 2>/dev/null
    fi
  done
  # Container processes left behind by killed shims: our namespace's cgroups.
  local cg
  for cg in /sys/fs/cgroup/"$NS"/*/cgroup.kill /sys/fs/cgroup/*/"$NS"/*/cgroup.kill; do
    [ -e "$cg" ] && echo 1 >"$cg" 2>/dev/null
  done
  # Mounts under our data directory (rootfs overlays), deepest first.
  awk -v d="$DATA" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
  collect_logs
  write_summary
  rm -rf "$DATA/root" "$DATA/state" "$DATA/tmp" "$DATA/rootfs" 2>/dev/null
  [ "$DRY" = 1 ] && [ -n "${scratch:-}" ] && rm -rf "$scratch"
  log "done in $(elapsed)s; results in $OUT"
  exec 1>&- 2>&-
  for _ in $(seq 50); do kill -0 "$TEE_PID" 2>/dev/null || break; sleep 0.1; done
  exit "$rc"
}

# shellcheck disable=SC2317 # run by the EXIT trap
collect_logs() {
  [ -f "$CTD_LOG" ] && gzip -c "$CTD_LOG" >"$OUT/containerd.log.gz"
  [ -d "$LOGS" ] && tar -C "$DATA" -czf "$OUT/logs.tar.gz" logs 2>/dev/null
}

# shellcheck disable=SC2317 # run by the EXIT trap
write_summary() {
  local n
  for n in ${EXPECTED:-}; do
    grep -q "^$n " "$RESULTS" || result "$n" FAIL 0 "no result (the run stopped before it)" >/dev/null
  done
  {
    echo "gpucr H200 end-to-end, $(date -u +%FT%TZ), $(elapsed)s, dry=$DRY"
    echo "host: $(uname -r); driver: $(head -1 /proc/driver/nvidia/version 2>/dev/null | sed 's/  */ /g')"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
    echo "versions: $(tr '\n' ';' <"$LOGS/versions.txt" 2>/dev/null)"
    echo
    echo "scenario   result  time   figures / details"
    cat "$RESULTS"
    echo
    echo "PASS $(grep -c ' PASS ' "$RESULTS") FAIL $(grep -c ' FAIL ' "$RESULTS") SKIP $(grep -c ' SKIP ' "$RESULTS")"
  } >"$OUT/summary.txt"
  echo "==================== summary ===================="
  cat "$OUT/summary.txt"
}

trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM
# Watchdog: the device tool's limit is 10 minutes; end the run (and its ctr calls) before.
# The main shell runs its trap only once its foreground command ends: the watchdog also stops
# the `timeout` children that every long command runs under.
(
  trap 'kill "$sp" 2>/dev/null; exit 0' TERM
  sleep $((BUDGET + 30)) &
  sp=$!
  wait "$sp"
  echo "[watchdog] budget + 30 s passed: stopping the run" >&2
  kill -TERM $$ 2>/dev/null
  sleep 1
  for c in $(pgrep -P $$ -x timeout); do kill -TERM "$c" 2>/dev/null; done
) &
WATCHDOG=$!

# ---------------------------------------------------------------- dependencies
first_file() { local f; for f in "$@"; do [ -f "$f" ] && { echo "$f"; return 0; }; done; return 0; }
setup_deps() {
  log "extracting .debs from $CARRY/debs into $TOOLS"
  [ -d "$CARRY/debs" ] || die "$CARRY/debs missing: run tests/gpu/prepare-carry.sh here and carry 'carry'"
  [ -f "$CARRY/bin/containerd-shim-gpucr-v2" ] || [ -f "$CARRY/bin/containerd-shim-gpucr-v2.xz" ] \
    || die "$CARRY/bin/containerd-shim-gpucr-v2(.xz) missing (prepare-carry.sh)"
  mkdir -p "$TOOLS" "$BIN" "$TOOLS/no-plugins" "$LOGS" "$DATA/tmp"
  local f
  for f in "$CARRY"/debs/*.deb; do dpkg -x "$f" "$TOOLS/root"; done
  local r=$TOOLS/root
  local libpath="$r/usr/lib/x86_64-linux-gnu:$r/lib/x86_64-linux-gnu"
  [ -x "$r/usr/sbin/criu" ] || die "criu not found in the extracted packages"
  cat >"$BIN/criu" <<EOF
#!/bin/sh
# CRIU from Debian packages extracted into $r. runc runs it from PATH.
export LD_LIBRARY_PATH="$libpath\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
# The stock baselines (a, stock-N) stand for a node without gpucr: while this file names a
# directory, CRIU loads its plugins from there (an empty one) instead of /usr/lib/criu, where
# install.sh put gpucr's plugin. Nothing of gpucr's is moved.
if [ -s "$TOOLS/criu-libs-dir" ]; then
  CRIU_LIBS_DIR=\$(cat "$TOOLS/criu-libs-dir"); export CRIU_LIBS_DIR
fi
# Scenario inst-hang: a CRIU that never returns.
if [ -e "$TOOLS/criu-hang" ]; then echo \$\$ >>"$TOOLS/criu-hung.pids"; exec sleep 600; fi
# A driver call in the plugin that never returns becomes a failed dump with a log line.
GPUCR_PLUGIN_CALL_TIMEOUT_S=\${GPUCR_PLUGIN_CALL_TIMEOUT_S:-60}; export GPUCR_PLUGIN_CALL_TIMEOUT_S
exec "$r/usr/sbin/criu" "\$@"
EOF
  chmod +x "$BIN/criu"
  if [ "$DRY" = 1 ] && ! "$BIN/criu" --version >/dev/null 2>&1 && host_criu=$(command -v criu); then
    # A CPU machine whose C library is older than the carried CRIU's (Debian 12): the host's
    # own CRIU and runc, without the carried libraries.
    sed -i -e "s#^exec \"$r/usr/sbin/criu\"#exec \"$host_criu\"#" -e '/^export LD_LIBRARY_PATH/d' "$BIN/criu"
    DRY_HOST_RUNC=$(command -v runc || true)
    log "dry run: the carried CRIU does not run here; using $host_criu and ${DRY_HOST_RUNC:-?}"
  fi
  local b
  for b in containerd ctr containerd-shim-runc-v2; do
    [ -x "$r/usr/bin/$b" ] || die "$b not found in the extracted containerd package"
    ln -sf "$r/usr/bin/$b" "$BIN/$b"
  done
  b=$(first_file "$r"/usr/sbin/runc "$r"/usr/bin/runc)
  [ -n "$b" ] || die "runc not found in the extracted packages"
  [ -n "${DRY_HOST_RUNC:-}" ] && b=$DRY_HOST_RUNC
  ln -sf "$b" "$BIN/runc"
  b=$(first_file "$r"/bin/busybox "$r"/usr/bin/busybox)
  [ -n "$b" ] || die "busybox not found in the extracted packages"
  ln -sf "$b" "$BIN/busybox"
  [ -f "$CARRY/bin/shim-ckpt" ] || die "$CARRY/bin/shim-ckpt missing (prepare-carry.sh)"
  install -m 0755 "$CARRY/bin/shim-ckpt" "$BIN/shim-ckpt"
  # The product goes where install/install.sh puts it, by install.sh itself (prebuilt files:
  # no cargo here): the shim and gpucr-copyin in /usr/local/bin, gpucr's CRIU plugin in
  # /usr/lib/criu (CRIU loads it for every dump and restore), the hook in /usr/lib/gpucr.
  local stage=$TOOLS/product
  rm -rf "$stage"; mkdir -p "$stage"
  if [ -f "$CARRY/bin/containerd-shim-gpucr-v2.xz" ]; then
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$CARRY/bin/containerd-shim-gpucr-v2.xz" "$stage/containerd-shim-gpucr-v2"
  else
    cp "$CARRY/bin/containerd-shim-gpucr-v2" "$stage/"
  fi
  for b in libgpucr_criu_plugin.so libgpucr_hook.so gpucr-copyin; do
    [ -f "$CARRY/bin/$b" ] || die "$CARRY/bin/$b missing (prepare-carry.sh)"
    cp "$CARRY/bin/$b" "$stage/"
  done
  chmod 0755 "$stage/containerd-shim-gpucr-v2" "$stage/gpucr-copyin"
  PATH="$BIN:$PATH" bash "$REPO/install/install.sh" --no-deps --from "$stage" >"$LOGS/install.txt" 2>&1 \
    || { cat "$LOGS/install.txt"; die "install/install.sh failed"; }
  log "installed: $(grep -c . "$LOGS/install.txt") lines (logs/install.txt); $(ls -l /usr/lib/criu | tail -n +2 | awk '{print $NF}' | tr '\n' ' ')"
  rm -f "$BIN/containerd-shim-gpucr-v2" "$BIN/gpucr-copyin"
  # The hook is installed, so gpucr injects it into every GPU container (io.gpucr.hook=auto);
  # GPUCR_E2E_HOOK=0 turns it off per container instead (start_workload).
  HOOK_ENV=()
  rm -f "$TOOLS/criu-libs-dir"
  export PATH="$BIN:$PATH"
  {
    echo "containerd: $(containerd --version 2>&1 | head -1)"
    echo "runc: $(runc --version 2>&1 | head -1)"
    echo "criu: $(criu --version 2>&1 | head -1)"
    echo "busybox: $(busybox 2>&1 | head -1)"
    echo "shim: $(sha256sum /usr/local/bin/containerd-shim-gpucr-v2 | cut -c1-12)"
  } | tee "$LOGS/versions.txt"
  log "criu check"
  if criu check >"$LOGS/criu-check.txt" 2>&1; then
    log "criu check: $(tail -1 "$LOGS/criu-check.txt")"
  else
    log "criu check failed (exit $?): $(tail -3 "$LOGS/criu-check.txt" | tr '\n' ' ')"
    [ "$DRY" = 1 ] || die "criu check failed"
  fi
}

# ---------------------------------------------------------------- containerd
start_containerd() {
  mkdir -p "$DATA/root" "$DATA/state" "$DATA/tmp"
  cat >"$DATA/config.toml" <<EOF
version = 2
root = "$DATA/root"
state = "$DATA/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp", "io.containerd.nri.v1.nri", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.blockfile"]

[grpc]
  address = "$SOCK"

[ttrpc]
  address = "$SOCK.ttrpc"

[debug]
  level = "debug"

[metrics]
  address = ""
EOF
  log "starting containerd (root $DATA)"
  # TMPDIR: containerd writes checkpoint dumps there before they enter the content store.
  mkdir -p "$DATA/cdi" "$CTD_TMP"
  log "containerd TMPDIR $CTD_TMP ($(stat -fc %T "$CTD_TMP"))"
  env "${HOOK_ENV[@]}" TMPDIR=$CTD_TMP GPUCR_CDI_SPEC_DIRS=$DATA/cdi containerd --config "$DATA/config.toml" </dev/null >"$CTD_LOG" 2>&1 &
  CTD_PID=$!
  local i
  for i in $(seq 100); do
    if [ -S "$SOCK" ] && CTR_T=5 cc version >/dev/null 2>&1; then
      log "containerd ready ($(CTR_T=5 cc version | awk '/Version/ {print $2; exit}'))"
      return 0
    fi
    kill -0 "$CTD_PID" 2>/dev/null || { tail -20 "$CTD_LOG"; die "containerd exited"; }
    sleep 0.2
  done
  tail -20 "$CTD_LOG"
  die "containerd did not answer within 20 s"
}

log_lines() { wc -l <"$CTD_LOG"; }

# ---------------------------------------------------------------- images
# import_rootfs DIR NAME: one-layer OCI image from DIR, imported with ctr.
import_rootfs() {
  local dir=$1 name=$2 w
  w=$(mktemp -d "$DATA/tmp/img.XXXXXX")
  mkdir -p "$w/oci/blobs/sha256"
  tar --sort=name --owner=0 --group=0 --numeric-owner -C "$dir" -cf "$w/layer.tar" .
  local diff_id layer layer_size cfg cfg_size man man_size
  diff_id=$(sha256sum "$w/layer.tar" | cut -d' ' -f1)
  gzip -1 -n -c "$w/layer.tar" >"$w/layer.tar.gz"
  rm -f "$w/layer.tar"
  layer=$(sha256sum "$w/layer.tar.gz" | cut -d' ' -f1)
  layer_size=$(stat -c %s "$w/layer.tar.gz")
  mv "$w/layer.tar.gz" "$w/oci/blobs/sha256/$layer"
  printf '{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"],"Cmd":["sh"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' "$diff_id" >"$w/config.json"
  cfg=$(sha256sum "$w/config.json" | cut -d' ' -f1)
  cfg_size=$(stat -c %s "$w/config.json")
  mv "$w/config.json" "$w/oci/blobs/sha256/$cfg"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s}]}' \
    "$cfg" "$cfg_size" "$layer" "$layer_size" >"$w/manifest.json"
  man=$(sha256sum "$w/manifest.json" | cut -d' ' -f1)
  man_size=$(stat -c %s "$w/manifest.json")
  mv "$w/manifest.json" "$w/oci/blobs/sha256/$man"
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"%s"}}]}' \
    "$man" "$man_size" "$name" >"$w/oci/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' >"$w/oci/oci-layout"
  tar -C "$w/oci" -cf "$w/image.tar" .
  CTR_T=300 cc image import --index-name "$name" "$w/image.tar" >/dev/null
  rm -rf "$w"
  log "image $name imported"
}

# busybox_rootfs DIR: busybox and its applets, /tmp, passwd.
busybox_rootfs() {
  local d=$1 a
  mkdir -p "$d/bin" "$d/tmp" "$d/proc" "$d/sys" "$d/dev" "$d/etc"
  chmod 1777 "$d/tmp"
  cp "$(readlink -f "$BIN/busybox")" "$d/bin/busybox"
  for a in $("$d/bin/busybox" --list); do [ "$a" = busybox ] || ln -sf busybox "$d/bin/$a"; done
  echo 'root:x:0:0:root:/:/bin/sh' >"$d/etc/passwd"
  echo 'root:x:0:' >"$d/etc/group"
}

# copy_libs ROOTFS FILE...: the shared libraries FILE... need (ldd), at the same paths.
copy_libs() {
  local root=$1
  shift
  local lib
  for lib in $(ldd "$@" 2>/dev/null | awk '/=> \// {print $3} /^\t\// {print $1}' | sort -u); do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
}

CPU_IMAGE=docker.io/library/busybox:gpucr
CUDA_IMAGE=docker.io/gpucr-e2e/cuda:1
TORCH_IMAGE=docker.io/gpucr-e2e/torch:1
TORCH_ARGS=()
TORCH_PY=python3

build_images() {
  log "busybox image (install/busybox-image.sh)"
  timeout 300 bash "$REPO/install/busybox-image.sh" "$CPU_IMAGE" -a "$SOCK" -n "$NS" >/dev/null
  [ "$DRY" = 1 ] && return 0

  log "CUDA image: busybox + workload + the libraries of workload and libcuda"
  local r=$DATA/rootfs/cuda
  busybox_rootfs "$r"
  cp "$TOOLS/workload" "$r/workload"
  copy_libs "$r" "$TOOLS/workload" "$(readlink -f /usr/local/nvidia/lib64/libcuda.so.1)" \
    $([ "${GPUCR_E2E_HOOK:-1}" = 1 ] && echo /usr/lib/gpucr/libgpucr_hook.so)
  mkdir -p "$r/usr/local/nvidia"
  (cd "$r" && find . -name '*.so*' | sort | tr '\n' ' ') >"$LOGS/cuda-rootfs-libs.txt"
  import_rootfs "$r" "$CUDA_IMAGE"

  log "PyTorch image: mount points for the host's python and torch (bound read-only)"
  local info
  info=$(python3 -c 'import os, sys, torch; print(os.path.dirname(torch.__file__)); print(sys.prefix); print(sys.base_prefix); print(os.path.realpath(sys.executable)); print(sys.executable)') \
    || { log "python3 cannot import torch on this host"; return 0; }
  TORCH_PY=$(echo "$info" | sed -n 5p)
  r=$DATA/rootfs/torch
  mkdir -p "$r/tmp" "$r/proc" "$r/sys" "$r/dev" "$r/etc" "$r/usr" "$r/usr/local/nvidia"
  chmod 1777 "$r/tmp"
  echo 'root:x:0:0:root:/root:/bin/sh' >"$r/etc/passwd"
  echo 'root:x:0:' >"$r/etc/group"
  cp /etc/ld.so.cache "$r/etc/ld.so.cache" 2>/dev/null || true
  cp "$REPO/tests/gpu/torch_workload.py" "$r/torch_workload.py"
  cp "$REPO/tests/gpu/torch_train.py" "$r/torch_train.py"
  cp "$REPO/tests/gpu/llm_decode.py" "$r/llm_decode.py"
  local binds=(/usr) d p top
  for d in bin sbin lib lib64 lib32 libx32; do
    if [ -L "/$d" ]; then
      ln -s "$(readlink "/$d")" "$r/$d"
    elif [ -d "/$d" ]; then
      binds+=("/$d")
    fi
  done
  while read -r p; do
    [ -n "$p" ] || continue
    top=$(findmnt -n -o TARGET --target "$p" 2>/dev/null || echo /)
    if [ "$top" = / ]; then top=/$(echo "$p" | cut -d/ -f2); fi
    case " ${binds[*]} " in *" $top "*) continue ;; esac
    case $top in /usr/*|/proc|/sys|/dev|/tmp|/) continue ;; esac
    binds+=("$top")
  done <<<"$info"
  for d in "${binds[@]}"; do
    mkdir -p "$r$d"
    TORCH_ARGS+=(--mount "type=bind,src=$d,dst=$d,options=bind:ro")
  done
  TORCH_ARGS+=(--env PYTHONDONTWRITEBYTECODE=1 --env HOME=/tmp --env PYTHONUNBUFFERED=1)
  echo "python: $TORCH_PY; binds: ${binds[*]}" | tee "$LOGS/torch-image.txt"
  import_rootfs "$r" "$TORCH_IMAGE"
}

# ---------------------------------------------------------------- workloads
GPU_ARGS=()
if [ "$DRY" != 1 ]; then
  for dev in /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools; do
    [ -e "$dev" ] && GPU_ARGS+=(--device "$dev")
  done
  GPU_ARGS+=(--mount "type=bind,src=/usr/local/nvidia,dst=/usr/local/nvidia,options=rbind:ro")
fi

build_programs() {
  log "nvcc workload.cu; gcc drive.c"
  command -v nvcc >/dev/null || PATH=$PATH:/usr/local/cuda/bin
  nvcc --version | tail -1
  timeout 180 nvcc -O2 -gencode arch=compute_90,code=sm_90 -o "$TOOLS/workload" "$REPO/tests/gpu/workload.cu"
  gcc -O2 -Wall -o "$TOOLS/drive" "$REPO/tests/gpu/drive.c" -ldl
}

# ref_run KIND GIB: the uninterrupted reference on the host -> $DATA/ref-KIND-GIB.txt
ref_run() {
  local kind=$1 gib=$2 steps=$3 t0
  local f=$DATA/ref-$kind-$gib.txt
  rm -f "$f"
  t0=$(now_ms)
  case $kind in
    cuda) timeout 180 "$TOOLS/workload" "$gib" "$steps" 0 "$f" ;;
    torch) timeout 180 "$TORCH_PY" "$REPO/tests/gpu/torch_workload.py" "$gib" "$steps" 0 "$f" ;;
    train) timeout 180 "$TORCH_PY" "$REPO/tests/gpu/torch_train.py" "$gib" "$steps" 0 "$f" ;;
    llm) timeout 180 "$TORCH_PY" "$REPO/tests/gpu/llm_decode.py" "$gib" "$steps" 0 "$f" ;;
    cpu) local i; for ((i = 0; i <= steps; i++)); do printf 'step %d hash %016x\n' "$i" "$i"; done >"$f" ;;
  esac
  cp "$f" "$LOGS/"
  log "reference $kind ${gib}GiB: $(wc -l <"$f") lines in $(secs_since "$t0")s"
}

# use_workload KIND GIB: sets WL_* for start_workload and verify.
use_workload() {
  WL_KIND=$1
  WL_GIB=$2
  WL_REF=$DATA/ref-$1-$2.txt
  WL_NOW=1
  WL_PAUSE=500
  WL_START_T=90
  [ "${2%%.*}" -ge 8 ] 2>/dev/null && WL_PAUSE=1000
  case $1 in
    cuda)
      WL_IMAGE=$CUDA_IMAGE
      WL_ARGS=("${GPU_ARGS[@]}" --env LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/lib/x86_64-linux-gnu:/lib64)
      WL_CMD=(/workload "$2" 0 "$WL_PAUSE" /tmp/steps) ;;
    torch)
      WL_IMAGE=$TORCH_IMAGE
      WL_START_T=180
      # The host's /usr first, then /usr/local/nvidia over it (mounts apply in order).
      WL_ARGS=("${TORCH_ARGS[@]}" "${GPU_ARGS[@]}" --env "LD_LIBRARY_PATH=/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
      WL_CMD=("$TORCH_PY" /torch_workload.py "$2" 0 "$WL_PAUSE" /tmp/steps) ;;
    train)
      WL_IMAGE=$TORCH_IMAGE
      WL_START_T=180
      WL_ARGS=("${TORCH_ARGS[@]}" "${GPU_ARGS[@]}" --env "LD_LIBRARY_PATH=/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
      WL_CMD=("$TORCH_PY" /torch_train.py "$2" 0 "$WL_PAUSE" /tmp/steps) ;;
    llm)
      WL_IMAGE=$TORCH_IMAGE
      WL_START_T=180
      WL_ARGS=("${TORCH_ARGS[@]}" "${GPU_ARGS[@]}" --env "LD_LIBRARY_PATH=/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
      WL_CMD=("$TORCH_PY" /llm_decode.py "$2" 0 "$WL_PAUSE" /tmp/steps) ;;
    cpu)
      WL_IMAGE=$CPU_IMAGE
      WL_NOW=0
      WL_ARGS=()
      # shellcheck disable=SC2016 # expanded by the container's shell
      WL_CMD=(sh -c 'i=0; while :; do printf "step %d hash %016x\n" $i $i >>/tmp/steps; i=$((i+1)); sleep 0.5; done') ;;
  esac
}

task_field() { CTR_T=20 cc task ls 2>/dev/null | awk -v id="$1" -v f="$2" '$1 == id {print $f}'; }
task_pid() { task_field "$1" 2; }
task_status() { task_field "$1" 3; }
steps_file() { echo "/proc/$1/root/tmp/steps"; }

# laststep PID: last step the workload wrote (-1: none yet)
laststep() { $HELPER laststep "$(steps_file "$1")"; }

# wait_step PID MIN SECONDS: until the workload wrote step >= MIN
wait_step() {
  local pid=$1 min=$2 secs=$3 t0 s
  t0=$(date +%s)
  while :; do
    s=$(laststep "$pid")
    [ "$s" -ge "$min" ] && return 0
    if ! kill -0 "$pid" 2>/dev/null; then log "pid $pid is gone (last step $s)"; return 1; fi
    if [ $(($(date +%s) - t0)) -ge "$secs" ]; then log "pid $pid: step $s after ${secs}s, wanted $min"; return 1; fi
    sleep 0.3
  done
}

# start_workload ID RUNTIME: ctr run -d, then wait for step 3.
start_workload() {
  local id=$1 rt=$2 pid
  log "start $id ($rt, $WL_KIND ${WL_GIB}GiB)"
  local extra=()
  [ "$rt" = "$GPUCR_RT" ] && [ "${GPUCR_E2E_HOOK:-1}" = 0 ] && extra=(--annotation io.gpucr.hook=off)
  CTR_T=60 cc run -d --runtime "$rt" --net-host --log-uri "file://$LOGS/$id.stdio" \
    "${WL_ARGS[@]}" "${extra[@]}" "$WL_IMAGE" "$id" "${WL_CMD[@]}" >/dev/null || { log "ctr run $id failed"; return 1; }
  pid=$(task_pid "$id")
  [ -n "$pid" ] || { log "no task for $id"; return 1; }
  wait_step "$pid" 3 "$WL_START_T" || { tail -5 "$LOGS/$id.stdio" 2>/dev/null; return 1; }
  log "$id: pid $pid at step $(laststep "$pid")"
}

# hash_now ID: SIGUSR1 -> a "now" line (hash of device memory as it is)
hash_now() {
  local id=$1 pid f n i
  [ "$WL_NOW" = 1 ] || return 0
  pid=$(task_pid "$id")
  f=$(steps_file "$pid")
  n=$(grep -c '^now' "$f" 2>/dev/null || true)
  CTR_T=10 cc task kill -s SIGUSR1 "$id" || return 1
  for i in $(seq 50); do
    [ "$(grep -c '^now' "$f" 2>/dev/null || true)" -gt "$n" ] && { grep '^now' "$f" | tail -1; return 0; }
    sleep 0.2
  done
  log "$id: no 'now' line after SIGUSR1"
  return 1
}

# verify ID LABEL: copy the steps and compare them with the reference; prints the verdict.
verify() {
  local id=$1 label=$2 pid
  pid=$(task_pid "$id")
  cp "$(steps_file "$pid")" "$LOGS/$id-$label.steps" 2>/dev/null || { echo "no steps file"; return 1; }
  $HELPER check "$WL_REF" "$LOGS/$id-$label.steps"
}

# save_bundle_logs ID: CRIU and runc logs of the task's bundle, before it is deleted.
save_bundle_logs() {
  local id=$1 b f dst
  b=$DATA/state/io.containerd.runtime.v2.task/$NS/$id
  [ -d "$b" ] || return 0
  dst=$LOGS/bundle-$id-$(date +%s%N | cut -c1-13)
  mkdir -p "$dst"
  find "$b" -maxdepth 2 -type f \( -name '*.log' -o -name '*.json' \) -size -4M 2>/dev/null | while read -r f; do
    cp "$f" "$dst/$(echo "${f#"$b"/}" | tr '/' '_')" 2>/dev/null || true
  done
}

# kill_rm ID: SIGKILL, wait for the exit, remove task and container (its pids are then free).
kill_rm() {
  local id=$1 i
  save_bundle_logs "$id"
  CTR_T=20 cc task kill -a -s SIGKILL "$id" >/dev/null 2>&1 || true
  for i in $(seq 100); do
    case $(task_status "$id") in STOPPED | "") break ;; esac
    sleep 0.1
  done
  CTR_T=30 cc task rm -f "$id" >/dev/null 2>&1 || true
  CTR_T=30 cc c rm "$id" >/dev/null 2>&1 || true
}

# criu_err ID: the first CRIU error in the task's bundle (dump or restore log), if any.
criu_err() {
  local b=$DATA/state/io.containerd.runtime.v2.task/$NS/$1 f
  for f in "$b/criu-dump.log" "$b/criu-work/dump.log" "$b/criu-work/restore.log" "$b/criu-restore.log"; do
    [ -f "$f" ] || continue
    grep -E 'Error \(' "$f" | grep -v RLIMIT_NOFILE | head -2 | sed "s|^|$(basename "$f"): |" | tr '\n' ' '
  done
  return 0
}

# unpacked_list: containerd's unpacked checkpoints in its TMPDIR, sorted.
unpacked_list() { find "$CTD_TMP" -maxdepth 1 -name 'ctrd-checkpoint*' 2>/dev/null | sort; }
image_digest() { CTR_T=30 cc image ls 2>/dev/null | awk -v r="$1" '$1 == r {print $3}'; }
bigt() { if [ "${WL_GIB%%.*}" -ge 8 ] 2>/dev/null; then echo 400; else echo 150; fi; }

# ---------------------------------------------------------------- one checkpoint/restore cycle
# cr_cycle ID MODE NAME: the task ID runs; `ctr c checkpoint --task --rw`, kill, rm,
# `ctr c restore --live --rw`, continuity. MODE gpucr (the shim drives the GPU), stock (drive.c
# by hand around the runc shim), plugin (runc shim, CRIU with gpucr's plugin).
cr_cycle() {
  local id=$1 mode=$2 name=$3 t_all pid before ref t0 off figs="" ok=1 out
  t_all=$(now_ms)
  ref=docker.io/gpucr-e2e/ckpt-$id:$(date +%s%N)
  pid=$(task_pid "$id")
  out=$(hash_now "$id") && figs+="before=[$out] " || ok=0
  before=$(laststep "$pid")
  local e2e_ms=0
  if [ "$mode" = stock ]; then
    t0=$(now_ms)
    if ! timeout 300 "$TOOLS/drive" quiesce "$pid" >"$LOGS/$id-drive-quiesce.txt" 2>&1; then
      cat "$LOGS/$id-drive-quiesce.txt"
      result "$name" FAIL "$(secs_since "$t_all")" "driver lock/checkpoint failed: $(tail -1 "$LOGS/$id-drive-quiesce.txt")"
      return 1
    fi
    e2e_ms=$(($(now_ms) - t0))
    figs+="lock_ms=$(awk '/^drive: lock/ {sub("ms=","",$5); print $5}' "$LOGS/$id-drive-quiesce.txt") "
    figs+="d2h_ms=$(awk '/^drive: checkpoint/ {sub("ms=","",$5); print $5}' "$LOGS/$id-drive-quiesce.txt") "
  fi
  off=$(log_lines)
  t0=$(now_ms)
  if ! CTR_T=$(bigt) cc c checkpoint --task --rw "$id" "$ref" >"$LOGS/$id-ckpt.txt" 2>&1; then
    log "$id: ctr c checkpoint failed: $(cat "$LOGS/$id-ckpt.txt")"
    result "$name" FAIL "$(secs_since "$t_all")" "$figs checkpoint failed: $(head -c 300 "$LOGS/$id-ckpt.txt" | tr '\n' ' ') $(criu_err "$id")"
    return 1
  fi
  local ck_ms=$(($(now_ms) - t0))
  e2e_ms=$((e2e_ms + ck_ms))
  figs+="ctr_checkpoint_s=$(awk -v m="$ck_ms" 'BEGIN {printf "%.2f", m/1000}') "
  cp "$(steps_file "$pid")" "$LOGS/$id-$name-at-checkpoint.steps" 2>/dev/null || true
  if [ "$mode" = gpucr ]; then
    tail -n +"$((off + 1))" "$CTD_LOG" >"$LOGS/$id-$name-ckpt-ctd.log"
    figs+="$($HELPER shimlog "$LOGS/$id-$name-ckpt-ctd.log" "$id") "
    local dg
    dg=$(image_digest "$ref")
    if [ -n "$dg" ] && $HELPER image-files "$CONTENT" "$dg" "$LOGS/$id-$name-image" gpucr-gpu.json gpucr-checkpoint.json gpucr-hook.json; then
      figs+="$($HELPER gpujson "$LOGS/$id-$name-image/gpucr-gpu.json" 2>/dev/null) "
      [ -f "$LOGS/$id-$name-image/gpucr-hook.json" ] \
        && figs+="hook=$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1])), separators=(",", ":")))' "$LOGS/$id-$name-image/gpucr-hook.json" | head -c 600) "
    fi
  fi
  figs+="image_mib=$(du -sm "$CONTENT" 2>/dev/null | cut -f1) "
  kill_rm "$id"
  # What containerd unpacked before (the stock shim's restores leave theirs there).
  local unpacked_before
  unpacked_before=$(unpacked_list)
  if [ -n "${CR_BEFORE_RESTORE:-}" ]; then "$CR_BEFORE_RESTORE" || ok=0; fi
  off=$(log_lines)
  t0=$(now_ms)
  if ! CTR_T=$(bigt) cc c restore --live --rw "$id" "$ref" >"$LOGS/$id-restore.txt" 2>&1; then
    log "$id: ctr c restore failed: $(cat "$LOGS/$id-restore.txt")"
    CTR_T=60 cc image rm --sync "$ref" >/dev/null 2>&1 || true
    result "$name" FAIL "$(secs_since "$t_all")" "$figs restore failed: $(head -c 300 "$LOGS/$id-restore.txt" | tr '\n' ' ') $(criu_err "$id")"
    return 1
  fi
  local rs_ms=$(($(now_ms) - t0))
  e2e_ms=$((e2e_ms + rs_ms))
  figs+="ctr_restore_s=$(awk -v m="$rs_ms" 'BEGIN {printf "%.2f", m/1000}') "
  pid=$(task_pid "$id")
  if [ "$mode" = stock ]; then
    t0=$(now_ms)
    if ! timeout 300 "$TOOLS/drive" resume "$pid" >"$LOGS/$id-drive-resume.txt" 2>&1; then
      cat "$LOGS/$id-drive-resume.txt"
      ok=0
    fi
    e2e_ms=$((e2e_ms + $(now_ms) - t0))
    figs+="h2d_ms=$(awk '/^drive: restore/ {sub("ms=","",$5); print $5}' "$LOGS/$id-drive-resume.txt") "
    figs+="unlock_ms=$(awk '/^drive: unlock/ {sub("ms=","",$5); print $5}' "$LOGS/$id-drive-resume.txt") "
  elif [ "$mode" = gpucr ]; then
    tail -n +"$((off + 1))" "$CTD_LOG" >"$LOGS/$id-$name-restore-ctd.log"
    figs+="$($HELPER shimlog "$LOGS/$id-$name-restore-ctd.log" "$id" | tr ' ' '\n' | grep -E '^(restore_ms|gpu_restored|hook_copy_in_ms|copy_in_gb_s|helpers|helper_bytes|helper_pin_wait_ms|helpers_failed)=' | tr '\n' ' ')"
  fi
  figs+="e2e_s=$(awk -v m="$e2e_ms" 'BEGIN {printf "%.2f", m/1000}') "
  CTR_T=120 cc image rm --sync "$ref" >/dev/null 2>&1 || log "$id: could not remove $ref"
  if [ -z "$pid" ] || ! wait_step "$pid" $((before + 3)) 60; then
    ok=0
  fi
  out=$(hash_now "$id") && figs+="after=[$out] " || ok=0
  if [ "$mode" = gpucr ]; then
    # gpucr removes containerd's unpacked copy of the checkpoint after the restore, in the
    # background (seconds for 17 GB just written to a disk: writeback).
    local left t_rm
    t_rm=$(now_ms)
    for _ in $(seq 120); do
      left=$(comm -13 <(echo "$unpacked_before") <(unpacked_list) | grep -c . || true)
      [ "$left" = 0 ] && break
      sleep 0.5
    done
    figs+="unpacked_left=$left unpacked_wait_s=$(secs_since "$t_rm") "
    [ "$left" = 0 ] || { log "$id: containerd's unpacked checkpoint is still in $CTD_TMP"; ok=0; }
  fi
  local v
  v=$(verify "$id" "$name") || ok=0
  if [ "$ok" = 1 ]; then
    result "$name" PASS "$(secs_since "$t_all")" "$v restored_from_step=$before $figs"
  else
    result "$name" FAIL "$(secs_since "$t_all")" "$v restored_from_step=$before $figs"
    return 1
  fi
}

# ---------------------------------------------------------------- scenarios
# a: the stock runc shim cannot checkpoint a CUDA task; the task keeps running.
scenario_a() {
  local id=$1 t0 pid before msg
  t0=$(now_ms)
  pid=$(task_pid "$id")
  before=$(laststep "$pid")
  if CTR_T=120 cc task checkpoint "$id" >"$LOGS/$id-a.txt" 2>&1; then
    result a FAIL "$(secs_since "$t0")" "ctr task checkpoint of a CUDA task succeeded on the stock runtime (unexpected)"
    for r in $(CTR_T=30 cc image ls -q | grep "^containerd.io/checkpoint/$id:"); do CTR_T=60 cc image rm --sync "$r" >/dev/null; done
    return 1
  fi
  msg=$(head -c 300 "$LOGS/$id-a.txt" | tr '\n' ' ')
  local dumplog=$DATA/state/io.containerd.runtime.v2.task/$NS/$id/criu-dump.log crit=""
  if [ -f "$dumplog" ]; then
    cp "$dumplog" "$LOGS/$id-a-criu-dump.log"
    crit=$(grep -E 'Error \(' "$dumplog" | grep -v RLIMIT_NOFILE | head -2 | tr '\n' ' ')
  fi
  local st
  st=$(task_status "$id")
  if [ "$st" = RUNNING ] && wait_step "$pid" $((before + 2)) 30; then
    result a PASS "$(secs_since "$t0")" "checkpoint refused as expected; task $st and stepping; ctr: $msg; criu-dump.log: $crit"
  else
    result a FAIL "$(secs_since "$t0")" "task $st after the failed checkpoint; ctr: $msg; criu-dump.log: $crit"
  fi
}

# b: gpucr `ctr task checkpoint` leaves the task running; then that checkpoint is restored.
scenario_b() {
  local id=$1 t0 pid before ref dg figs=""
  t0=$(now_ms)
  pid=$(task_pid "$id")
  local out
  out=$(hash_now "$id") && figs+="before=[$out] "
  before=$(laststep "$pid")
  local off
  off=$(log_lines)
  local prev
  prev=$(CTR_T=30 cc image ls -q | grep "^containerd.io/checkpoint/$id:" || true)
  if ! CTR_T=$(bigt) cc task checkpoint "$id" >"$LOGS/$id-b.txt" 2>&1; then
    result b FAIL "$(secs_since "$t0")" "ctr task checkpoint failed: $(head -c 300 "$LOGS/$id-b.txt" | tr '\n' ' ') $(criu_err "$id")"
    return 1
  fi
  local ck_s
  ck_s=$(secs_since "$t0")
  tail -n +"$((off + 1))" "$CTD_LOG" >"$LOGS/$id-b-ckpt-ctd.log"
  figs+="ctr_checkpoint_s=$ck_s $($HELPER shimlog "$LOGS/$id-b-ckpt-ctd.log" "$id") "
  local v ok=1
  wait_step "$pid" $((before + 3)) 60 || ok=0
  out=$(hash_now "$id") && figs+="after=[$out] " || ok=0
  v=$(verify "$id" b) || ok=0
  if [ "$ok" = 1 ]; then
    result b PASS "$(secs_since "$t0")" "$v still_running_after_step=$before (ctr 1.7 sends no --exit to non-runc runtimes) $figs"
  else
    result b FAIL "$(secs_since "$t0")" "$v $figs"
    return 1
  fi

  # b-restore: the `ctr task checkpoint` image, repackaged for `ctr container restore`.
  t0=$(now_ms)
  ref=$(CTR_T=30 cc image ls -q | grep "^containerd.io/checkpoint/$id:" | grep -vxF -- "$prev" | tail -1 || true)
  [ -n "$ref" ] || { result b-restore FAIL 0 "no containerd.io/checkpoint/$id:* image"; return 1; }
  dg=$(image_digest "$ref")
  local repacked=docker.io/gpucr-e2e/repacked-$id:1
  kill_rm "$id"
  if ! REPACK_REF=$repacked $HELPER repack "$CONTENT" "$dg" "$GPUCR_RT" overlayfs 1 \
    | CTR_T=$(bigt) cc image import --no-unpack - >"$LOGS/$id-b-import.txt" 2>&1; then
    result b-restore FAIL "$(secs_since "$t0")" "repack/import failed: $(head -c 300 "$LOGS/$id-b-import.txt")"
    return 1
  fi
  local rt0
  rt0=$(now_ms)
  off=$(log_lines)
  if ! CTR_T=$(bigt) cc c restore --live --rw "$id" "$repacked" >"$LOGS/$id-b-restore.txt" 2>&1; then
    CTR_T=60 cc image rm --sync "$repacked" "$ref" >/dev/null 2>&1 || true
    result b-restore FAIL "$(secs_since "$t0")" "ctr c restore failed: $(head -c 300 "$LOGS/$id-b-restore.txt" | tr '\n' ' ') $(criu_err "$id")"
    return 1
  fi
  figs="ctr_restore_s=$(secs_since "$rt0") "
  tail -n +"$((off + 1))" "$CTD_LOG" >"$LOGS/$id-b-restore-ctd.log"
  figs+="$($HELPER shimlog "$LOGS/$id-b-restore-ctd.log" "$id") "
  CTR_T=120 cc image rm --sync "$repacked" "$ref" >/dev/null 2>&1 || log "could not remove $repacked $ref"
  pid=$(task_pid "$id")
  ok=1
  [ -n "$pid" ] && wait_step "$pid" $((before + 3)) 60 || ok=0
  out=$(hash_now "$id") && figs+="after=[$out] " || ok=0
  v=$(verify "$id" b-restore) || ok=0
  if [ "$ok" = 1 ]; then
    result b-restore PASS "$(secs_since "$t0")" "$v $figs"
  else
    result b-restore FAIL "$(secs_since "$t0")" "$v $figs"
    return 1
  fi
}

# scenario_s ID NAME: the shim's Checkpoint over ttrpc with no Pause around it (shim-ckpt: what a
# client that does not pause sends; ctr, CRI and nerdctl pause the task), so with the hook gpucr
# takes its leave-running snapshot path: the device memory is copied on the GPU, the task runs on
# while the image is written. Then NAME-restore: kill, `ctr c restore --live` of that directory.
scenario_s() {
  local id=$1 name=$2 mode=${3:-} t0 pid before figs="" ok=1 out off dir spec ref v exitflag=()
  [ "$mode" = exit ] && exitflag=(--exit)
  t0=$(now_ms)
  pid=$(task_pid "$id")
  out=$(hash_now "$id") && figs+="before=[$out] "
  before=$(laststep "$pid")
  spec=$LOGS/$id-$name-spec.json
  if ! CTR_T=30 cc c info --spec "$id" >"$spec" 2>"$LOGS/$id-$name-spec.err"; then
    result "$name" FAIL 0 "ctr c info --spec failed: $(head -c 300 "$LOGS/$id-$name-spec.err")"
    return 1
  fi
  dir=$DATA/ckpt-$name
  rm -rf "$dir"
  off=$(log_lines)
  if ! timeout -k 5 "$(bigt)" "$BIN/shim-ckpt" checkpoint "$DATA/state/io.containerd.runtime.v2.task/$NS/$id/address" \
    "$NS" "$id" "$dir" "${exitflag[@]}" >"$LOGS/$id-$name.txt" 2>&1; then
    result "$name" FAIL "$(secs_since "$t0")" "shim Checkpoint failed: $(head -c 300 "$LOGS/$id-$name.txt" | tr '\n' ' ') $(criu_err "$id")"
    return 1
  fi
  tail -n +"$((off + 1))" "$CTD_LOG" >"$LOGS/$id-$name-ckpt-ctd.log"
  figs+="$(tr '\n' ' ' <"$LOGS/$id-$name.txt")$($HELPER shimlog "$LOGS/$id-$name-ckpt-ctd.log" "$id") "
  figs+="image_mib=$(du -sm "$dir" | cut -f1) "
  if [ "$mode" = exit ]; then
    # CRIU killed the task; its rootfs stays mounted in the bundle until the task is deleted.
    [ "${GPUCR_E2E_HOOK:-1}" = 1 ] && [ "$DRY" != 1 ] && { grep -q "copy-out prepared while the process runs" \
      "$LOGS/$id-$name-ckpt-ctd.log" || { ok=0; figs+="NOT_PREPARED "; }; }
    local i st=""
    for i in $(seq 50); do st=$(task_status "$id"); [ "$st" = STOPPED ] && break; sleep 0.2; done
    [ "$st" = STOPPED ] || { ok=0; figs+="status=$st "; }
    cp "$DATA/state/io.containerd.runtime.v2.task/$NS/$id/rootfs/tmp/steps" "$LOGS/$id-$name-at-kill.steps" || ok=0
    if [ "$ok" = 1 ]; then
      result "$name" PASS "$(secs_since "$t0")" "exited at the checkpoint after step $before $figs"
    else
      result "$name" FAIL "$(secs_since "$t0")" "$figs"
      return 1
    fi
  else
    if [ "${GPUCR_E2E_HOOK:-1}" = 1 ] && [ "$DRY" != 1 ]; then
      grep -q "snapshot written while the process runs" "$LOGS/$id-$name-ckpt-ctd.log" \
        || { ok=0; figs+="NO_SNAPSHOT "; }
    fi
    wait_step "$pid" $((before + 3)) 60 || ok=0
    out=$(hash_now "$id") && figs+="after=[$out] " || ok=0
    v=$(verify "$id" "$name") || ok=0
    if [ "$ok" = 1 ]; then
      result "$name" PASS "$(secs_since "$t0")" "$v still_running_after_step=$before $figs"
    else
      result "$name" FAIL "$(secs_since "$t0")" "$v $figs"
      return 1
    fi
    # No rw layer travels: the restored process writes a fresh /tmp/steps, checked after these.
    cp "$(steps_file "$pid")" "$LOGS/$id-$name-at-kill.steps"
  fi

  t0=$(now_ms)
  figs=""
  ref=docker.io/gpucr-e2e/shim-ckpt-$id:1
  kill_rm "$id"
  if ! { "$BIN/shim-ckpt" layout "$dir" "$WL_IMAGE" "$GPUCR_RT" "$spec" "$ref" \
    | CTR_T=$(bigt) cc image import --no-unpack -; } >"$LOGS/$id-$name-import.txt" 2>&1; then
    result "$name-restore" FAIL "$(secs_since "$t0")" "layout/import failed: $(head -c 300 "$LOGS/$id-$name-import.txt")"
    return 1
  fi
  local rt0
  rt0=$(now_ms)
  off=$(log_lines)
  if ! CTR_T=$(bigt) cc c restore --live "$id" "$ref" >"$LOGS/$id-$name-restore.txt" 2>&1; then
    CTR_T=60 cc image rm --sync "$ref" >/dev/null 2>&1 || true
    result "$name-restore" FAIL "$(secs_since "$t0")" "ctr c restore failed: $(head -c 300 "$LOGS/$id-$name-restore.txt" | tr '\n' ' ') $(criu_err "$id")"
    return 1
  fi
  figs+="ctr_restore_s=$(secs_since "$rt0") "
  tail -n +"$((off + 1))" "$CTD_LOG" >"$LOGS/$id-$name-restore-ctd.log"
  figs+="$($HELPER shimlog "$LOGS/$id-$name-restore-ctd.log" "$id") "
  CTR_T=120 cc image rm --sync "$ref" >/dev/null 2>&1 || log "could not remove $ref"
  rm -rf "$dir"
  pid=$(task_pid "$id")
  ok=1
  [ -n "$pid" ] && wait_step "$pid" $((before + 3)) 60 || ok=0
  out=$(hash_now "$id") && figs+="after=[$out] " || ok=0
  cp "$(steps_file "$pid")" "$LOGS/$id-$name-restored.steps" 2>/dev/null || ok=0
  $HELPER splice "$LOGS/$id-$name-at-kill.steps" "$LOGS/$id-$name-restored.steps" "$LOGS/$id-$name-restore.steps"
  v=$($HELPER check "$WL_REF" "$LOGS/$id-$name-restore.steps") || ok=0
  if [ "$ok" = 1 ]; then
    result "$name-restore" PASS "$(secs_since "$t0")" "$v $figs"
  else
    result "$name-restore" FAIL "$(secs_since "$t0")" "$v $figs"
    return 1
  fi
}

# want NAME...: whether GPUCR_E2E_ONLY (when set) names one of them.
want() {
  [ -z "${GPUCR_E2E_ONLY:-}" ] && return 0
  local n
  for n in "$@"; do case " $GPUCR_E2E_ONLY " in *" $n "*) return 0 ;; esac; done
  SKIP_WHY="not in GPUCR_E2E_ONLY"
  return 1
}
# baseline on|off: the stock runs stand for a node without gpucr (see the criu wrapper).
baseline() {
  if [ "$1" = on ]; then echo "$TOOLS/no-plugins" >"$TOOLS/criu-libs-dir"; else rm -f "$TOOLS/criu-libs-dir"; fi
}
skip_all() { local n; for n in "$@"; do result "$n" SKIP 0 "${SKIP_WHY:-not run}"; done; }
enough() { [ "$(left)" -ge "$1" ] || { log "only $(left)s left of the budget: skipping $2"; SKIP_WHY="time budget"; return 1; }; }

# ---------------------------------------------------------------- main
log "gpucr GPU end-to-end: dry=$DRY tools=$TOOLS data=$DATA out=$OUT budget=${BUDGET}s"
if [ "$DRY" != 1 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || die "no GPU (set GPUCR_E2E_DRY=1 on CPU machines)"
  log "cgroup filesystem: $(stat -fc %T /sys/fs/cgroup)"
fi
# A former run's mounts and data (same paths) would get in the way.
awk -v d="$DATA" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
rm -rf "$DATA"
mkdir -p "$DATA" "$LOGS"

setup_deps
start_containerd
ctr run --help 2>&1 | grep -qE -- '--device' || die "this ctr has no 'run --device'"

if [ "$DRY" = 1 ]; then
  build_images
  EXPECTED="smoke-runc.v2 smoke-gpucr.v2 b b-restore s-cpu s-cpu-restore x-cpu x-cpu-restore c-cpu-gpucr c-cpu-runc"
  log "smoke: busybox through both runtimes"
  for rt in "$RUNC_RT" "$GPUCR_RT"; do
    t0=$(now_ms)
    if o=$(CTR_T=60 cc run --rm --runtime "$rt" --net-host "$CPU_IMAGE" "smoke-${rt//./-}" echo hello 2>&1) && [ "$o" = hello ]; then
      result "smoke-${rt##*.containerd.}" PASS "$(secs_since "$t0")" "ctr run --rm echo through $rt"
    else
      result "smoke-${rt##*.containerd.}" FAIL "$(secs_since "$t0")" "$o"
    fi
  done
  ref_run cpu 0 2000
  use_workload cpu 0
  if start_workload cpudc "$GPUCR_RT"; then
    scenario_b cpudc || true
    [ "$(task_status cpudc)" = RUNNING ] || { kill_rm cpudc; start_workload cpudc "$GPUCR_RT" || true; }
    scenario_s cpudc s-cpu || true
    # The restored container's /tmp/steps starts at its restore: the next needs a fresh one.
    kill_rm cpudc
    start_workload cpudc "$GPUCR_RT" || true
    scenario_s cpudc x-cpu exit || true
    kill_rm cpudc
    start_workload cpudc "$GPUCR_RT" || true
    cr_cycle cpudc gpucr c-cpu-gpucr || true
    kill_rm cpudc
  else
    result c-cpu-gpucr FAIL 0 "start failed"
  fi
  if start_workload cpurc "$RUNC_RT"; then
    cr_cycle cpurc plugin c-cpu-runc || true
    kill_rm cpurc
  else
    result c-cpu-runc FAIL 0 "start failed"
  fi
  exit 0
fi

EXPECTED="a stock-$SMALL b b-restore s s-restore x x-restore c cdi full e d t twice-$BIG twice-$BIG-2 plugin-twice plugin-twice-2 llm llm-2 train-twice train-twice-2 hang hang-after gpucr-$BIG stock-$BIG"
build_programs
build_images
ref_run cuda "$SMALL" 1500

# a + stock-SMALL: one runc container.
use_workload cuda "$SMALL"
if [ "${GPUCR_E2E_SKIP_STOCK:-0}" = 1 ]; then
  SKIP_WHY="GPUCR_E2E_SKIP_STOCK=1" skip_all a "stock-$SMALL"
elif ! want a "stock-$SMALL"; then
  skip_all a "stock-$SMALL"
elif baseline on && start_workload stock "$RUNC_RT"; then
  scenario_a stock || true
  cr_cycle stock stock "stock-$SMALL" || true
else
  result a FAIL 0 "the CUDA container did not start (see logs/stock.stdio)"
fi
kill_rm stock
baseline off

# b + c: gpucr, one container (b's restore, if it works, is the container c checkpoints).
if ! want b b-restore c; then
  skip_all b b-restore c
elif start_workload gpucr "$GPUCR_RT"; then
  if want b b-restore; then scenario_b gpucr || true; else skip_all b b-restore; fi
  if [ "$(task_status gpucr)" != RUNNING ]; then
    kill_rm gpucr
    start_workload gpucr "$GPUCR_RT" || true
  fi
  if want c; then cr_cycle gpucr gpucr c || true; else skip_all c; fi
else
  result b FAIL 0 "the CUDA container did not start (see logs/gpucr.stdio)"
fi
kill_rm gpucr

# s + s-restore: gpucr with the hook, a checkpoint no client pauses (the snapshot path);
# x + x-restore: the same with exit (the shim prepares the hook's copy-out while it runs).
# unpaused ID NAME [exit]: one of them in a container of its own.
unpaused() {
  if [ "${GPUCR_E2E_HOOK:-1}" != 1 ]; then
    SKIP_WHY="needs GPUCR_E2E_HOOK=1" skip_all "$2" "$2-restore"
  elif ! want "$2" "$2-restore"; then
    skip_all "$2" "$2-restore"
  elif start_workload "$1" "$GPUCR_RT"; then
    scenario_s "$@" || true
  else
    result "$2" FAIL 0 "the CUDA container did not start (see logs/$1.stdio)"
  fi
  kill_rm "$1"
}
unpaused snap s
unpaused xit x exit

# cdi (issues 5 and 6): the GPU comes from a CDI spec (nvidia.com/gpu=0: device nodes, the
# driver directory, the GPU's UUID in NVIDIA_VISIBLE_DEVICES), not from ctr flags. Between
# checkpoint and restore the spec is regenerated as another node would have it: the driver
# directory at another host path. The restore must follow the new spec, and with
# io.gpucr.gpu-pairs=always the driver gets the (identical) old->new GPU UUID pair.
GPU_UUID=""
write_cdi_spec() {
  local driver_dir=$1 nodes="" dev
  for dev in /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools; do
    [ -e "$dev" ] && nodes+="${nodes:+,}{\"path\": \"$dev\"}"
  done
  cat >"$DATA/cdi/nvidia.json" <<EOF
{"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu",
 "devices": [{"name": "0", "containerEdits": {
   "env": ["NVIDIA_VISIBLE_DEVICES=$GPU_UUID"],
   "deviceNodes": [$nodes],
   "mounts": [{"hostPath": "$driver_dir", "containerPath": "/usr/local/nvidia", "options": ["ro", "rbind"]}]}}]}
EOF
  cp "$DATA/cdi/nvidia.json" "$LOGS/cdi-spec-$(basename "$driver_dir").json"
}
cdi_move_driver() {
  mkdir -p "$DATA/nvidia-moved"
  mount --bind /usr/local/nvidia "$DATA/nvidia-moved" || return 1
  write_cdi_spec "$DATA/nvidia-moved"
  log "cdi: spec regenerated with the driver at $DATA/nvidia-moved"
}
scenario_cdi() {
  GPU_UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1 | tr -d ' ')
  [ -n "$GPU_UUID" ] || { result cdi FAIL 0 "no GPU UUID from nvidia-smi"; return 1; }
  write_cdi_spec /usr/local/nvidia
  use_workload cuda "$SMALL"
  WL_ARGS=(--annotation "cdi.k8s.io/gpucr-e2e=nvidia.com/gpu=0" --annotation io.gpucr.gpu-pairs=always
    --env LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/lib/x86_64-linux-gnu:/lib64)
  start_workload cdi "$GPUCR_RT" || { result cdi FAIL 0 "the CDI CUDA container did not start (see logs/cdi.stdio)"; return 1; }
  CR_BEFORE_RESTORE=cdi_move_driver cr_cycle cdi gpucr cdi || true
  local b=$DATA/state/io.containerd.runtime.v2.task/$NS/cdi
  cp "$b/config.json" "$LOGS/cdi-restored-config.json" 2>/dev/null || true
  if grep -q nvidia-moved "$b/config.json" 2>/dev/null; then
    log "cdi: the restored spec mounts the driver from the moved path"
  else
    log "cdi: the restored spec does NOT name the moved driver path"
  fi
  grep -ho 'gpu_pairs=[0-9]*' "$LOGS"/cdi-cdi-restore-ctd.log 2>/dev/null | tail -1 | sed 's/^/cdi: driver restore got /' >&2 || true
}

# full: a restore onto a GPU without room for the checkpoint's device memory is refused when
# the task is created, before anything runs; the checkpoint is left as it was and restores
# once the memory is free (cr_cycle's own restore, right after this). Run as cr_cycle's
# CR_BEFORE_RESTORE: it sees cr_cycle's id, ref and figs (bash locals are dynamic).
full_gpu_refusal() {
  local hog_log=$LOGS/full-hog.txt hog rc=0 _
  # A host process holds all but 256 MiB of what the GPU has free.
  "$TORCH_PY" -c '
import time, torch
free, _ = torch.cuda.mem_get_info()
x = torch.empty(max(free - (256 << 20), 0), dtype=torch.uint8, device="cuda")
print("held", x.numel() >> 20, "MiB", flush=True)
time.sleep(300)' >"$hog_log" 2>&1 &
  hog=$!
  for _ in $(seq 200); do
    grep -q '^held' "$hog_log" && break
    kill -0 "$hog" 2>/dev/null || break
    sleep 0.3
  done
  if ! grep -q '^held' "$hog_log"; then
    log "full: the memory hog did not start: $(tail -2 "$hog_log")"
    kill "$hog" 2>/dev/null; wait "$hog" 2>/dev/null
    return 1
  fi
  log "full: $(head -1 "$hog_log"); GPU free now $(nvidia-smi --query-gpu=memory.free --format=csv,noheader | head -1)"
  if CTR_T=$(bigt) cc c restore --live --rw "$id" "$ref" >"$LOGS/$id-refused.txt" 2>&1; then
    log "full: the restore was NOT refused"
    rc=1
  elif ! grep -q 'free GPU memory first' "$LOGS/$id-refused.txt"; then
    log "full: refused, but not for the GPU's memory: $(head -c 400 "$LOGS/$id-refused.txt")"
    rc=1
  else
    log "full: refused: $(grep -o 'this host cannot restore[^:]*: [^;]*' "$LOGS/$id-refused.txt" | head -1)"
    figs+="refused=1 "
  fi
  # Nothing of the refused restore may be left: no task, and the checkpoint still there.
  if [ -n "$(task_status "$id")" ]; then
    log "full: the refused restore left a task ($(task_status "$id"))"
    figs+="left_task=1 "
    rc=1
    CTR_T=20 cc task rm -f "$id" >/dev/null 2>&1 || true
  fi
  [ -n "$(image_digest "$ref")" ] || { log "full: the checkpoint $ref is gone"; rc=1; }
  # ctr c restore created the container record before the task was refused.
  CTR_T=30 cc c rm "$id" >/dev/null 2>&1 || true
  kill "$hog" 2>/dev/null
  wait "$hog" 2>/dev/null
  return $rc
}

if ! want cdi; then
  skip_all cdi
elif enough 60 cdi; then
  scenario_cdi || true
  kill_rm cdi
else
  skip_all cdi
fi

if [ -z "${TORCH_ARGS[*]}" ]; then
  result full SKIP 0 "python3 with torch not found on the host (it holds the GPU's memory)"
elif ! want full; then
  skip_all full
elif enough 60 full; then
  use_workload cuda "$SMALL"
  if start_workload full "$GPUCR_RT"; then
    CR_BEFORE_RESTORE=full_gpu_refusal cr_cycle full gpucr full || true
  else
    result full FAIL 0 "the CUDA container did not start (see logs/full.stdio)"
  fi
  kill_rm full
else
  skip_all full
fi

# e_diag PID LABEL: why a plugin-driven checkpoint hangs: the task's cgroup freezer, its threads'
# states, CRIU's stack, and the driver's state of the process.
e_diag() {
  # Written straight into $OUT (not $LOGS): a hung run still brings it back. Every read has
  # its own timeout: in session 3 the diagnostics themselves never returned.
  local pid=$1 label=$2 f=$OUT/e-diag-$2.txt cg t c
  local rd="timeout -s KILL 3"
  {
    echo "== task $pid ($(date +%T))"
    cg=$($rd awk -F: '$1 == "0" {print $3}' "/proc/$pid/cgroup" 2>/dev/null)
    echo "cgroup $cg freeze=$($rd cat "/sys/fs/cgroup$cg/cgroup.freeze" 2>/dev/null) events: $($rd cat "/sys/fs/cgroup$cg/cgroup.events" 2>/dev/null | tr '\n' ' ')"
    # Only files that do not take the task's mm lock (a task stuck in the driver may hold
    # it; reading cmdline, environ, maps or status then blocks): comm, wchan, stack.
    for t in /proc/"$pid"/task/*; do
      echo "thread ${t##*/} $($rd cat "$t/comm" 2>/dev/null) wchan=$($rd cat "$t/wchan" 2>/dev/null)"
      $rd cat "$t/stack" 2>/dev/null | head -8 | sed 's/^/    /'
    done
    for c in /proc/[0-9]*; do
      [ "$($rd cat "$c/comm" 2>/dev/null)" = criu ] || continue
      echo "== criu ${c#/proc/}"
      for t in "$c"/task/*; do
        echo "criu thread ${t##*/} wchan=$($rd cat "$t/wchan" 2>/dev/null)"
        $rd cat "$t/stack" 2>/dev/null | head -8 | sed 's/^/    /'
      done
    done
    [ -n "${3:-}" ] && { echo "== ${3} (tail)"; $rd tail -40 "$3" 2>/dev/null; }
    echo "== driver state"; timeout -s KILL 10 "$TOOLS/drive" state "$pid" 2>&1 | tail -3
  } >"$f" 2>&1
  log "e ($label): $(head -3 "$f" | tr '\n' ' ')"
}

# e: runc + CRIU with gpucr's plugin only (no gpucr shim, no ctr in the checkpoint path).
# ctr pauses (cgroup-freezes) a task before every checkpoint, and the driver's lock runs on a
# thread inside the process, so a frozen task cannot be locked: a user of plain runc/podman
# checkpoints a running task. runc drives CRIU here; the CRIU wrapper sets CRIU_LIBS_DIR.
scenario_e_runc() {
  local id=plugin t0 pid before figs="" ok=1 root=/run/containerd/runc/$NS
  local b=$DATA/state/io.containerd.runtime.v2.task/$NS/$id
  local img1=$DATA/e-img1 img2=$DATA/e-img2 w1=$DATA/e-w1 w2=$DATA/e-w2 w3=$DATA/e-w3
  local nb=$DATA/e-bundle rroot=$DATA/e-runc
  rm -rf "$img1" "$img2" "$w1" "$w2" "$w3" "$nb" "$rroot"
  mkdir -p "$img1" "$img2" "$w1" "$w2" "$w3" "$nb" "$rroot"
  t0=$(now_ms)
  pid=$(task_pid "$id")
  before=$(laststep "$pid")
  # 1) leave-running: lock + checkpoint in PAUSE/CHECKPOINT_DEVICES, restore + unlock at exit.
  timeout ${GPUCR_E2E_E_TIMEOUT_S:-45} runc --root "$root" checkpoint --image-path "$img1" --work-path "$w1" \
    --leave-running "$id" >"$LOGS/e-ckpt1.txt" 2>&1 &
  local cpid=$! waited=0 rc
  while kill -0 "$cpid" 2>/dev/null; do
    sleep 1
    waited=$((waited + 1))
    [ "$waited" = 12 ] && e_diag "$pid" at-15s "$w1/dump.log"
  done
  wait "$cpid"; rc=$?
  if [ "$rc" != 0 ]; then
    e_diag "$pid" after-exit "$w1/dump.log"
    [ "$(cat "/sys/fs/cgroup$(awk -F: '$1 == "0" {print $3}' "/proc/$pid/cgroup")/cgroup.freeze" 2>/dev/null)" = 1 ] \
      && echo 0 >"/sys/fs/cgroup$(awk -F: '$1 == "0" {print $3}' "/proc/$pid/cgroup")/cgroup.freeze"
    cp "$w1/dump.log" "$LOGS/e-dump1.log" 2>/dev/null || true
    cp "$w1/dump.log" "$OUT/e-dump1.log" 2>/dev/null || true
    result e FAIL "$(secs_since "$t0")" "runc checkpoint --leave-running failed: $(head -c 200 "$LOGS/e-ckpt1.txt" | tr '\n' ' ') $(grep -E 'Error \(' "$w1/dump.log" 2>/dev/null | grep -v RLIMIT | head -2 | tr '\n' ' ')"
    return 1
  fi
  cp "$w1/dump.log" "$LOGS/e-dump1.log" 2>/dev/null || true
  figs+="leave_running_s=$(secs_since "$t0") plugin_lines=$(grep -ciE 'cuda' "$w1/dump.log" 2>/dev/null || echo 0) "
  wait_step "$pid" $((before + 3)) 60 || { ok=0; figs+="(did not go on after the leave-running dump) "; }
  # 2) exit: dump and kill, then `runc restore` into a new container over the same rootfs.
  before=$(laststep "$pid")
  t0=$(now_ms)
  if ! timeout 300 runc --root "$root" checkpoint --image-path "$img2" --work-path "$w2" "$id" \
      >"$LOGS/e-ckpt2.txt" 2>&1; then
    cp "$w2/dump.log" "$LOGS/e-dump2.log" 2>/dev/null || true
    result e FAIL "$(secs_since "$t0")" "$figs runc checkpoint failed: $(head -c 200 "$LOGS/e-ckpt2.txt" | tr '\n' ' ')"
    return 1
  fi
  figs+="dump_s=$(secs_since "$t0") image_mib=$(du -sm "$img2" | cut -f1) "
  python3 - "$b/config.json" "$nb/config.json" "$b/rootfs" <<'PY'
import json, sys
spec = json.load(open(sys.argv[1]))
spec["root"]["path"] = sys.argv[3]
spec["linux"]["cgroupsPath"] = "/gpucr-e2e-restored"
json.dump(spec, open(sys.argv[2], "w"))
PY
  t0=$(now_ms)
  if ! timeout 300 runc --root "$rroot" restore -d --image-path "$img2" --work-path "$w3" \
      --bundle "$nb" e-restored </dev/null >"$LOGS/e-restored.stdio" 2>&1; then
    cp "$w3/restore.log" "$LOGS/e-restore.log" 2>/dev/null || true
    result e FAIL "$(secs_since "$t0")" "$figs runc restore failed: $(grep -E 'Error \(' "$w3/restore.log" 2>/dev/null | grep -v RLIMIT | head -2 | tr '\n' ' ')"
    return 1
  fi
  cp "$w3/restore.log" "$LOGS/e-restore.log" 2>/dev/null || true
  figs+="restore_s=$(secs_since "$t0") "
  pid=$(runc --root "$rroot" state e-restored | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
  if ! wait_step "$pid" $((before + 3)) 60; then ok=0; fi
  cp "$(steps_file "$pid")" "$LOGS/plugin-e.steps" 2>/dev/null || ok=0
  local v
  v=$($HELPER check "$WL_REF" "$LOGS/plugin-e.steps") || ok=0
  runc --root "$rroot" kill e-restored KILL >/dev/null 2>&1 || true
  sleep 1
  runc --root "$rroot" delete -f e-restored >/dev/null 2>&1 || true
  if [ "$ok" = 1 ]; then
    result e PASS "$(secs_since "$t0")" "$v restored_from_step=$before $figs"
  else
    result e FAIL "$(secs_since "$t0")" "$v $figs"
    return 1
  fi
}

if ! want e; then
  skip_all e
elif enough 40 e; then
  # The runc shim with gpucr's installed plugin (plain runc's path).
  use_workload cuda "$SMALL"
  if start_workload plugin "$RUNC_RT"; then
    scenario_e_runc || true
  else
    result e FAIL 0 "the CUDA container did not start"
  fi
  kill_rm plugin
else
  skip_all e
fi

# d: PyTorch.
if [ -z "${TORCH_ARGS[*]}" ]; then
  result d SKIP 0 "python3 with torch not found on the host"
elif ! want d; then
  skip_all d
elif enough 90 d; then
  use_workload torch 1
  if ! ref_run torch 1 400; then
    result d FAIL 0 "the PyTorch reference run failed on the host"
  elif start_workload torch "$GPUCR_RT"; then
    cr_cycle torch gpucr d || true
  else
    result d FAIL 0 "the PyTorch container did not start (see logs/torch.stdio)"
  fi
  kill_rm torch
else
  skip_all d
fi

# t: a PyTorch training loop (issue 4): the loss sequence after restore equals the
# uninterrupted run's, bit for bit.
if [ -z "${TORCH_ARGS[*]}" ]; then
  result t SKIP 0 "python3 with torch not found on the host"
elif ! want t; then
  skip_all t
elif enough 90 t; then
  use_workload train 2
  if ! ref_run train 2 600; then
    result t FAIL 0 "the training reference run failed on the host"
  elif start_workload train "$GPUCR_RT"; then
    cr_cycle train gpucr t || true
  else
    result t FAIL 0 "the training container did not start (see logs/train.stdio)"
  fi
  kill_rm train
else
  skip_all t
fi

# twice-N: the installed layout with default annotations: checkpoint, kill, restore, then the
# restored container again (issue 19: the fast path by default, a second cycle).
# plugin-twice: the same at SMALL GiB with the GPU handed to gpucr's CRIU plugin
# (io.gpucr.gpu-quiesce=plugin; the hook is injected but does not move memory).
# twice ID NAME: two cr_cycles of the running container ID.
twice() {
  cr_cycle "$1" gpucr "$2" && cr_cycle "$1" gpucr "$2-2"
}
if ! want "twice-$BIG" "twice-$BIG-2"; then
  skip_all "twice-$BIG" "twice-$BIG-2"
elif enough 200 "twice-$BIG"; then
  use_workload cuda "$BIG"
  if ! ref_run cuda "$BIG" 400; then
    result "twice-$BIG" FAIL 0 "the ${BIG} GiB reference run failed on the host"
  elif start_workload twice "$GPUCR_RT"; then
    twice twice "twice-$BIG" || true
  else
    result "twice-$BIG" FAIL 0 "the CUDA container did not start"
  fi
  kill_rm twice
else
  skip_all "twice-$BIG" "twice-$BIG-2"
fi
if ! want plugin-twice plugin-twice-2; then
  skip_all plugin-twice plugin-twice-2
elif enough 90 plugin-twice; then
  use_workload cuda "$SMALL"
  WL_ARGS+=(--annotation io.gpucr.gpu-quiesce=plugin)
  if start_workload plugin-twice "$GPUCR_RT"; then
    twice plugin-twice plugin-twice || true
  else
    result plugin-twice FAIL 0 "the CUDA container did not start"
  fi
  kill_rm plugin-twice
else
  skip_all plugin-twice plugin-twice-2
fi

# llm / train-twice: real workloads on the installed layout, two cycles each: an LLM server's
# greedy decode loop (llm_decode.py, 8 GiB of bf16 weights: every token after each restore the
# uninterrupted run's) and the training loop with Adam (torch_train.py: every loss bit-identical).
if [ -z "${TORCH_ARGS[*]}" ]; then
  result llm SKIP 0 "python3 with torch not found on the host"
elif ! want llm llm-2; then
  skip_all llm llm-2
elif enough 150 llm; then
  use_workload llm 8
  if ! ref_run llm 8 400; then
    result llm FAIL 0 "the decode reference run failed on the host"
  elif start_workload llm "$GPUCR_RT"; then
    twice llm llm || true
  else
    result llm FAIL 0 "the decode container did not start (see logs/llm.stdio)"
  fi
  kill_rm llm
else
  skip_all llm llm-2
fi
if [ -z "${TORCH_ARGS[*]}" ]; then
  result train-twice SKIP 0 "python3 with torch not found on the host"
elif ! want train-twice train-twice-2; then
  skip_all train-twice train-twice-2
elif enough 120 train-twice; then
  use_workload train 4
  if ! ref_run train 4 600; then
    result train-twice FAIL 0 "the training reference run failed on the host"
  elif start_workload train2 "$GPUCR_RT"; then
    twice train2 train-twice || true
  else
    result train-twice FAIL 0 "the training container did not start (see logs/train2.stdio)"
  fi
  kill_rm train2
else
  skip_all train-twice train-twice-2
fi

# hang: CRIU never returns (the criu wrapper sleeps): the checkpoint fails at its deadline
# (annotation io.gpucr.checkpoint-timeout-s=20) naming the step, State answers meanwhile, the
# task runs on with its GPU given back; then the same container checkpoints and restores
# (hang-after), its device memory exact.
scenario_hang() {
  local id=$1 t0 pid before ok=1 figs="" ref st
  t0=$(now_ms)
  pid=$(task_pid "$id")
  before=$(laststep "$pid")
  ref=docker.io/gpucr-e2e/hang:$(date +%s%N)
  : >"$TOOLS/criu-hung.pids"
  touch "$TOOLS/criu-hang"
  (
    sleep 8
    local t
    t=$(now_ms)
    echo "state_during=$(task_status "$id") state_ms=$(($(now_ms) - t))" >"$LOGS/hang-state.txt"
  ) &
  local asker=$!
  if CTR_T=150 cc c checkpoint --task --rw "$id" "$ref" >"$LOGS/hang-ckpt.txt" 2>&1; then
    ok=0
    figs+="checkpoint_succeeded "
  fi
  wait "$asker" || true
  rm -f "$TOOLS/criu-hang"
  figs+="failed_after_s=$(secs_since "$t0") $(cat "$LOGS/hang-state.txt" 2>/dev/null) "
  grep -q "did not finish within 20s" "$LOGS/hang-ckpt.txt" || { ok=0; figs+="no_deadline_error "; }
  figs+="error=[$(grep -o 'runc checkpoint did not finish[^;]*' "$LOGS/hang-ckpt.txt" | head -1)] "
  local p alive=0
  for p in $(cat "$TOOLS/criu-hung.pids"); do kill -0 "$p" 2>/dev/null && alive=$((alive + 1)); done
  figs+="hung_criu=$(grep -c . "$TOOLS/criu-hung.pids") hung_alive=$alive "
  [ "$alive" = 0 ] || ok=0
  st=$(task_status "$id")
  figs+="state_after=$st "
  [ "$st" = RUNNING ] || ok=0
  wait_step "$pid" $((before + 3)) 60 || ok=0
  local out
  out=$(hash_now "$id") && figs+="after=[$out] " || ok=0
  if [ "$ok" = 1 ]; then
    result hang PASS "$(secs_since "$t0")" "$figs"
  else
    result hang FAIL "$(secs_since "$t0")" "$figs $(head -c 400 "$LOGS/hang-ckpt.txt" | tr '\n' ' ')"
  fi
  cr_cycle "$id" gpucr hang-after || true
}
if ! want hang hang-after; then
  skip_all hang hang-after
elif enough 90 hang; then
  use_workload cuda "$SMALL"
  WL_ARGS+=(--annotation io.gpucr.checkpoint-timeout-s=20)
  if start_workload hang "$GPUCR_RT"; then
    scenario_hang hang || true
  else
    result hang FAIL 0 "the CUDA container did not start"
  fi
  kill_rm hang
else
  skip_all hang hang-after
fi

# f: the big runs, gpucr and stock side by side.
if [ "$SKIP_BIG" = 1 ]; then
  SKIP_WHY="GPUCR_E2E_SKIP_BIG=1" skip_all "gpucr-$BIG" "stock-$BIG"
elif ! want "gpucr-$BIG" "stock-$BIG" "gpucr-$BIG-h0"; then
  skip_all "gpucr-$BIG" "stock-$BIG"
elif enough 150 "gpucr-$BIG"; then
  use_workload cuda "$BIG"
  if ! ref_run cuda "$BIG" 400; then
    result "gpucr-$BIG" FAIL 0 "the ${BIG} GiB reference run failed on the host"
  else
    if ! want "gpucr-$BIG-h0"; then
      :
    elif ! enough 100 "gpucr-$BIG-h0"; then
      skip_all "gpucr-$BIG-h0"
    else
      # The same with the restore's copy-in helpers off, side by side.
      local_args=("${WL_ARGS[@]}")
      WL_ARGS+=(--annotation io.gpucr.restore-helpers=0)
      if start_workload gpucr-big-h0 "$GPUCR_RT"; then
        cr_cycle gpucr-big-h0 gpucr "gpucr-$BIG-h0" || true
      else
        result "gpucr-$BIG-h0" FAIL 0 "the CUDA container did not start"
      fi
      WL_ARGS=("${local_args[@]}")
      kill_rm gpucr-big-h0
    fi
    if start_workload gpucr-big "$GPUCR_RT"; then
      cr_cycle gpucr-big gpucr "gpucr-$BIG" || true
    else
      result "gpucr-$BIG" FAIL 0 "the CUDA container did not start"
    fi
  fi
  kill_rm gpucr-big
  if enough 140 "stock-$BIG"; then
    baseline on
    if start_workload stock-big "$RUNC_RT"; then
      cr_cycle stock-big stock "stock-$BIG" || true
    else
      result "stock-$BIG" FAIL 0 "the CUDA container did not start"
    fi
    kill_rm stock-big
    baseline off
  else
    skip_all "stock-$BIG"
  fi
else
  skip_all "gpucr-$BIG" "stock-$BIG"
fi
exit 0
