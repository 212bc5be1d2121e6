#!/usr/bin/env bash
# gpucr hook fast path on the H200, in one call (issue 4). Needs carry/bin/libgpucr_hook.so
# (tests/gpu/prepare-carry.sh) and, for the container part, what h200-e2e.sh needs.
#
#   bash tests/gpu/h200-hook.sh
#
# 0. overhead: launches, small copies and allocations with and without the hook (overhead.cu)
# 1. ceilings: pinned/pageable cudaMemcpy (pinned_ceiling.cu), the disk's O_DIRECT write
#    and read speed (dd) and tmpfs's (tmpfs_ceiling.c: 16 threads, first and second touch),
#    measured in this run. GPUCR_HOOK_PROBES="keeper": keeper_probe.cu (device memory held
#    by another process across the driver's cycle); "register": register_probe.cu (how fast a
#    tmpfs file is pinned for DMA, direct vs staged vs both feeding the copy-in;
#    GPUCR_HOOK_PROBE_WIN_MIB windows); "xproc": xproc_probe.cu (staged and registered copy-ins
#    of one 16 GiB file split between processes started at once). GPUCR_HOOK_WARM_GIB=N: write and drop N GiB
#    of tmpfs before the benchmarks (a fresh VM's first touch of its memory is slower; a
#    long-running node's memory is warm). GPUCR_HOOK_OVERHEAD=0 skips step 0;
#    GPUCR_HOOK_OVERHEAD_ROUNDS (3) interleaved rounds; GPUCR_HOOK_OVERHEAD_VARIANT="VAR=V"
#    adds the hook with these settings to each round (e.g. GPUCR_HOOK_KEEP=0).
#    GPUCR_HOOK_TMPFS_HUGE=1: images (and the tmpfs ceiling) on a tmpfs with huge=always.
# 2. host-level, side by side in one process per size (hook_bench.py): the driver alone vs
#    the hook's freeze -> copy-out -> release -> driver checkpoint of the rest -> restore ->
#    remap -> copy-in -> thaw; copy-out into local disk; an incremental copy-out against the
#    first image. Sizes: GPUCR_HOOK_SIZES (default "4+0 1+15": changing GiB + static GiB,
#    each optionally :PHASES, e.g. "1+63:driver,fast,incr")
#    GPUCR_HOOK_SWEEP: hook settings side by side at GPUCR_HOOK_SWEEP_SIZE (phases
#    GPUCR_HOOK_SWEEP_PHASES, default fast; GPUCR_SWEEP_SHM=1 in a setting puts its images
#    on /dev/shm, 4 KiB pages; GPUCR_SWEEP_NODE=N|gpu|far runs it on the CPUs of
#    NUMA node N, the GPU's node or another one)
# 3. containers (GPUCR_HOOK_E2E, default "c d"): h200-e2e.sh with GPUCR_E2E_HOOK=1 — gpucr
#    injects the hook and checkpoints/restores through it; hashes checked against references
# Results: $OUT/hook-results.jsonl, $OUT/hook-summary.txt, and h200-e2e.sh's files.
# GPUCR_HOOK_BUDGET_S (default 540): the container part gets what is left.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$REPO/hook-out}
CARRY=${GPUCR_E2E_CARRY:-$REPO/carry}
TOOLS=/opt/gpucr-hook
TMPFS=/dev/shm/gpucr-hook
DISK=/var/tmp/gpucr-hook
BUDGET=${GPUCR_HOOK_BUDGET_S:-540}
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
log() { echo "[$(elapsed)s] $*"; }
mkdir -p "$OUT" "$TOOLS" "$TMPFS" "$DISK"
# GPUCR_HOOK_TMPFS_HUGE=1: the images go to a tmpfs of its own mounted with huge=always
# (2 MiB pages in the page cache: fewer faults on first touch, far fewer pages to pin for
# direct copies) instead of /dev/shm.
if [ "${GPUCR_HOOK_TMPFS_HUGE:-0}" = 1 ]; then
  mount -t tmpfs -o huge=always,size=110g gpucr-hook-huge "$TMPFS" && echo "tmpfs: huge=always at $TMPFS"
fi
RES=$OUT/hook-results.jsonl
SUM=$OUT/hook-summary.txt
: >"$RES"
: >"$SUM"
HOOK=$CARRY/bin/libgpucr_hook.so
[ -f "$HOOK" ] || { log "FATAL: $HOOK missing"; exit 1; }
install -m 0755 "$HOOK" "$TOOLS/libgpucr_hook.so"
# The copy-in helper (used when a setting has GPUCR_HOOK_COPYIN_HELPERS=N).
if [ -f "$CARRY/bin/gpucr-copyin" ]; then
  install -m 0755 "$CARRY/bin/gpucr-copyin" "$TOOLS/gpucr-copyin"
  export GPUCR_HOOK_HELPER=$TOOLS/gpucr-copyin
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader | tee -a "$SUM"
# The host's NUMA layout and the GPU's node: where the staging buffers and the image's
# pages sit decides how far the DMA and the readers' copies travel.
gpu_bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f' | sed 's/^0000//')
gpu_node=$(cat /sys/bus/pci/devices/0000${gpu_bus#0000}/numa_node 2>/dev/null || echo '?')
{
  echo "cpus $(nproc), numa nodes: $(ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l), gpu $gpu_bus on node $gpu_node"
  for n in /sys/devices/system/node/node*; do
    [ -d "$n" ] && echo "  $(basename "$n"): cpus $(cat "$n/cpulist") mem $(awk '/MemTotal/ {print int($(NF-1)/1048576) " GiB"}' "$n/meminfo")"
  done
} | tee -a "$SUM"
command -v nvcc >/dev/null || PATH=$PATH:/usr/local/cuda/bin
log "build: workload, pinned_ceiling, drive"
nvcc -O2 -gencode arch=compute_90,code=sm_90 -o "$TOOLS/workload" "$REPO/tests/gpu/workload.cu" || exit 1
nvcc -O2 -gencode arch=compute_90,code=sm_90 -o "$TOOLS/pinned_ceiling" "$REPO/tests/gpu/pinned_ceiling.cu" || exit 1
gcc -O2 -Wall -o "$TOOLS/drive" "$REPO/tests/gpu/drive.c" -ldl || exit 1
echo "hook: $(sha256sum "$TOOLS/libgpucr_hook.so" | cut -c1-12) $(nm -D --defined-only "$TOOLS/libgpucr_hook.so" | grep -c ' T cu') cu* exports" | tee -a "$SUM"

if [ "${GPUCR_HOOK_OVERHEAD:-1}" != 0 ]; then
  log "overhead: the same program without / with the hook, interleaved 3 times"
  nvcc -O2 -gencode arch=compute_90,code=sm_90 -o "$TOOLS/overhead" "$REPO/tests/gpu/overhead.cu" || exit 1
  mkdir -p "$TMPFS/ovh-sock"
  for i in $(seq "${GPUCR_HOOK_OVERHEAD_ROUNDS:-3}"); do
    echo "no-hook $(timeout 60 "$TOOLS/overhead")" | tee -a "$SUM"
    echo "hook    $(LD_PRELOAD=$TOOLS/libgpucr_hook.so GPUCR_HOOK_SOCKET_DIR=$TMPFS/ovh-sock timeout 60 "$TOOLS/overhead")" | tee -a "$SUM"
    # GPUCR_HOOK_OVERHEAD_VARIANT="VAR=V ...": the hook again with these settings.
    if [ -n "${GPUCR_HOOK_OVERHEAD_VARIANT:-}" ]; then
      # shellcheck disable=SC2086 # one VAR=V word per setting
      echo "hook+${GPUCR_HOOK_OVERHEAD_VARIANT// /,} $(env $GPUCR_HOOK_OVERHEAD_VARIANT LD_PRELOAD=$TOOLS/libgpucr_hook.so GPUCR_HOOK_SOCKET_DIR=$TMPFS/ovh-sock timeout 60 "$TOOLS/overhead")" | tee -a "$SUM"
    fi
  done
  rm -rf "$TMPFS/ovh-sock"
fi

log "ceilings"
timeout 120 "$TOOLS/pinned_ceiling" 4 | tee -a "$SUM"
sync
dd_w=$(dd if=/dev/zero of="$DISK/dd.bin" bs=64M count=64 oflag=direct 2>&1 | tail -1)
dd_r=$(dd if="$DISK/dd.bin" of=/dev/null bs=64M iflag=direct 2>&1 | tail -1)
rm -f "$DISK/dd.bin"
echo "disk $DISK ($(df -h --output=source,fstype "$DISK" | tail -1 | tr -s ' ')): write 4 GiB O_DIRECT: $dd_w; read: $dd_r" | tee -a "$SUM"
gcc -O2 -Wall -pthread -o "$TOOLS/tmpfs_ceiling" "$REPO/tests/gpu/tmpfs_ceiling.c" || exit 1
timeout 120 "$TOOLS/tmpfs_ceiling" "$TMPFS" 16 16 | tee -a "$SUM"

for probe in ${GPUCR_HOOK_PROBES:-}; do
  case $probe in
    keeper)
      nvcc -O2 -o "$TOOLS/keeper_probe" "$REPO/tests/gpu/keeper_probe.cu" -lcuda || continue
      for mode in fdonly import; do
        log "keeper probe $mode 16 GiB"
        timeout 120 "$TOOLS/keeper_probe" "$mode" 16 2>&1 | tee -a "$SUM"
      done ;;
    register)
      nvcc -O2 -o "$TOOLS/register_probe" "$REPO/tests/gpu/register_probe.cu" -lcuda || continue
      for w in ${GPUCR_HOOK_PROBE_WIN_MIB:-512}; do
        log "register probe 16 GiB, windows of $w MiB"
        timeout 240 "$TOOLS/register_probe" "$TMPFS" 16 "$w" 2>&1 | tee -a "$SUM"
      done ;;
    xproc)
      nvcc -O2 -o "$TOOLS/xproc_probe" "$REPO/tests/gpu/xproc_probe.cu" -lcuda || continue
      f=$TMPFS/xproc.bin
      "$TOOLS/xproc_probe" mkfile "$f" 16
      # Each set: processes started at the same instant, "MODE:OFF_GIB:LEN_GIB[:DIRECT_GIB]"
      # each, joined by '+'.
      # shellcheck disable=SC2086 # GPUCR_HOOK_XPROC_SETS: one set per word, ' ' -> '+'
      for set in ${GPUCR_HOOK_XPROC_SETS:-staged:0:16 direct:0:16 staged:0:8+direct:8:8 direct:0:8+direct:8:8 \
                 staged:0:8+staged:8:8 staged:0:6+direct:6:10 direct:0:4+direct:4:4+direct:8:4+direct:12:4 \
                 staged:0:8+direct:8:4+direct:12:4}; do
        set=${set//+/ }
        start=$(( $(date +%s%N) + 5000000000 ))
        pids=()
        for p in $set; do
          IFS=: read -r mode off len dgib <<<"$p"
          timeout 60 "$TOOLS/xproc_probe" "$mode" "$f" "$off" "$len" "$start" ${dgib:+"$dgib"} >"$TMPFS/xproc.$off.out" 2>&1 &
          pids+=($!)
        done
        wait "${pids[@]}"
        end=$(cat "$TMPFS"/xproc.*.out | sed -n 's/.*end_ns=\([0-9]*\).*/\1/p' | sort -n | tail -1)
        echo "xproc [$set] all: $(awk -v e="${end:-0}" -v s="$start" 'BEGIN { printf "s=%.3f gbps=%.1f", (e - s) / 1e9, 16 * 1.073741824 / ((e - s) / 1e9) }')" | tee -a "$SUM"
        sed 's/^/    /' "$TMPFS"/xproc.*.out | tee -a "$SUM"
        rm -f "$TMPFS"/xproc.*.out
      done
      rm -f "$f" ;;
  esac
done
if [ "${GPUCR_HOOK_WARM_GIB:-0}" -gt 0 ]; then
  log "warming ${GPUCR_HOOK_WARM_GIB} GiB of memory"
  timeout 300 "$TOOLS/tmpfs_ceiling" "$TMPFS" "$GPUCR_HOOK_WARM_GIB" 16 1 | sed 's/^tmpfs/warm-up/' | tee -a "$SUM"
  timeout 120 "$TOOLS/tmpfs_ceiling" "$TMPFS" 16 16 1 | sed 's/pass=1/warm/' | tee -a "$SUM"
fi

for spec in ${GPUCR_HOOK_SIZES:-4+0 1+15}; do
  # SIZE[:PHASES], e.g. 1+63:driver,fast,incr (no disk copy of 64 GiB)
  size=${spec%%:*}
  phases=driver,fast,disk,incr
  [ "$spec" != "$size" ] && phases=${spec#*:}
  g=${size%+*}
  st=${size#*+}
  [ "$(elapsed)" -lt $((BUDGET - 150)) ] || { log "budget: skipping size $size"; echo "size $size: SKIPPED (budget)" >>"$SUM"; continue; }
  ref=$TMPFS/ref-$g.txt
  if [ ! -s "$ref" ]; then
    log "reference run ${g} GiB"
    timeout 200 "$TOOLS/workload" "$g" 1500 0 "$ref" 2>&1 | tail -1
  fi
  log "hook_bench $size"
  timeout 400 python3 "$REPO/tests/gpu/hook_bench.py" --workload "$TOOLS/workload" --drive "$TOOLS/drive" \
    --hook "$TOOLS/libgpucr_hook.so" --gib "$g" --static-gib "$st" --ref "$ref" \
    --tmpfs "$TMPFS" --disk "$DISK" --out "$RES" --label "$size" --phases "$phases"
  echo "size $size: hook_bench exit $?" | tee -a "$SUM"
done
# Settings side by side at one size (fast path only): GPUCR_HOOK_SWEEP="LABEL:VAR=V,VAR=V ...",
# e.g. "direct:GPUCR_HOOK_DIRECT=1 s8:GPUCR_HOOK_STREAMS=8 c64:GPUCR_HOOK_CHUNK_MIB=64".
sweep_size=${GPUCR_HOOK_SWEEP_SIZE:-1+15}
for entry in ${GPUCR_HOOK_SWEEP:-}; do
  [ "$(elapsed)" -lt $((BUDGET - 120)) ] || { echo "sweep $entry: SKIPPED (budget)" >>"$SUM"; continue; }
  label=${entry%%:*}
  vars=${entry#*:}
  g=${sweep_size%+*}
  st=${sweep_size#*+}
  ref=$TMPFS/ref-$g.txt
  [ -s "$ref" ] || timeout 200 "$TOOLS/workload" "$g" 1500 0 "$ref" >/dev/null 2>&1
  # GPUCR_SWEEP_SHM=1 in a setting: its images go to /dev/shm (4 KiB pages) instead.
  images=$TMPFS
  case ",$vars," in *,GPUCR_SWEEP_SHM=1,*) images=/dev/shm/gpucr-hook-shm; mkdir -p "$images" ;; esac
  # GPUCR_SWEEP_NODE=N in a setting: the bench (workload, hook threads, the pages they
  # first touch) runs on node N's CPUs only.
  pin=()
  node=$(echo ",$vars," | sed -n 's/.*,GPUCR_SWEEP_NODE=\([a-z0-9]*\),.*/\1/p')
  case $node in
    gpu) node=$gpu_node ;;
    far) node=$(ls -d /sys/devices/system/node/node* | sed 's/.*node//' | grep -vx "$gpu_node" | head -1) ;;
  esac
  if [ -n "$node" ]; then
    [ -r "/sys/devices/system/node/node$node/cpulist" ] || { echo "sweep $label: SKIPPED (no NUMA node '$node')" | tee -a "$SUM"; continue; }
    pin=(taskset -c "$(cat "/sys/devices/system/node/node$node/cpulist")")
  elif [ -n "$(echo ",$vars," | grep ',GPUCR_SWEEP_NODE=')" ]; then
    echo "sweep $label: SKIPPED (no such NUMA node)" | tee -a "$SUM"; continue
  fi
  log "sweep $label ($vars) at $sweep_size, images in $images ${pin[*]}"
  # shellcheck disable=SC2046 # one VAR=V word per setting
  env $(echo "$vars" | tr ',' ' ') "${pin[@]}" timeout 300 python3 "$REPO/tests/gpu/hook_bench.py" \
    --workload "$TOOLS/workload" --drive "$TOOLS/drive" --hook "$TOOLS/libgpucr_hook.so" \
    --gib "$g" --static-gib "$st" --ref "$ref" --tmpfs "$images" --disk "$DISK" --out "$RES" \
    --label "$sweep_size-$label" --phases "${GPUCR_HOOK_SWEEP_PHASES:-fast}"
  echo "sweep $label ($vars): hook_bench exit $?" | tee -a "$SUM"
  [ "$images" = "$TMPFS" ] || rm -rf "$images"
done
grep -h '"phase"' "$RES" >>"$SUM" 2>/dev/null

left=$((BUDGET - $(elapsed)))
if [ -n "${GPUCR_HOOK_E2E-c d}" ] && [ "$left" -gt 120 ]; then
  log "containers through gpucr with the hook: ${GPUCR_HOOK_E2E-c d} (${left}s left)"
  GPUCR_E2E_HOOK=1 GPUCR_E2E_ONLY="${GPUCR_HOOK_E2E-c d}" GPUCR_E2E_BUDGET_S=$((left - 40)) \
    OUT=$OUT bash "$REPO/tests/gpu/h200-e2e.sh" >"$OUT/e2e.log" 2>&1
  echo "h200-e2e.sh (hook) exit $?" | tee -a "$SUM"
  cat "$OUT/results.txt" >>"$SUM" 2>/dev/null
fi
if mountpoint -q "$TMPFS"; then umount "$TMPFS"; fi
rm -rf "$TMPFS" "$DISK"
log "done"
cat "$SUM"
