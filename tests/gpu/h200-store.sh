#!/usr/bin/env bash
# Checkpoints by reference on the GPU machine (issue 22), in one call: h200-e2e.sh's
# scenarios (default twice-16 twice-16-2: a 16 GiB CUDA container with the hook, two
# `ctr c checkpoint --task --rw` / `ctr c restore --live --rw` cycles, every step checked
# against an uninterrupted run) once per store mode, side by side: inline (the image
# self-contained, through containerd's tar), local (its large files in the node's store,
# on tmpfs; the hook writes its GPU state into the store's stage, which takes it in as a
# pack, and a restore reads it from there in place; the second checkpoint adds only the
# chunks that changed) and shared (also
# pushed to a shared store directory; before each restore the node's own store is emptied,
# so the restore pulls every chunk back from the shared store, whose plain read speed is
# measured there too: shared-read.txt).
#
#   tests/gpu/prepare-carry.sh; device: bash tests/gpu/h200-store.sh, carry ["carry"]
#
# GPUCR_STORE_SIDES (default "inline local"; "shared" too), GPUCR_STORE_SCENARIOS, GPUCR_STORE_BUDGET_S
# (per side, default 270). Results: $OUT/MODE/ (h200-e2e.sh's files), $OUT/store-summary.txt.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$REPO/store-out}
mkdir -p "$OUT"
SUM=$OUT/store-summary.txt
: >"$SUM"
export GPUCR_E2E_SKIP_STOCK=1
for mode in ${GPUCR_STORE_SIDES:-inline local}; do
  store=/dev/shm/gpucr-store-$mode
  rm -rf "$store"
  echo "[$(date -u +%T)] mode $mode: store $store" | tee -a "$SUM"
  shared_dir=""
  wipe=""
  if [ "$mode" = shared ]; then
    shared_dir=/dev/shm/gpucr-shared
    rm -rf "$shared_dir"
    mkdir -p "$shared_dir" "$OUT/$mode"
    # Run by h200-e2e.sh's cr_cycle between the checkpoint and the restore: the node's store
    # loses its chunks and manifests, and the shared store's chunks are read once (16
    # readers) for its own speed.
    wipe=/tmp/gpucr-store-wipe.sh
    cat >"$wipe" <<WIPE
#!/usr/bin/env bash
find "$store/chunks" "$store/manifests" "$store/packs" -type f -delete 2>/dev/null
t0=\$(date +%s%N)
bytes=\$(find "$shared_dir/chunks" -type f -printf '%s\n' | awk '{s+=\$1} END {print s+0}')
find "$shared_dir/chunks" -type f -print0 | xargs -0 -P 16 -n 64 cat >/dev/null
ms=\$(( (\$(date +%s%N) - t0) / 1000000 ))
echo "shared store read: \$bytes bytes in \$ms ms (\$(awk -v b=\$bytes -v m=\$ms 'BEGIN {printf "%.1f", b/1e6/(m>0?m:1)}') GB/s)" >>"$OUT/$mode/shared-read.txt"
WIPE
    chmod +x "$wipe"
  fi
  GPUCR_STORE=$store GPUCR_STORE_MODE=$mode GPUCR_STORE_SHARED=$shared_dir CR_BEFORE_RESTORE=$wipe \
    GPUCR_E2E_ONLY="${GPUCR_STORE_SCENARIOS:-twice-16 twice-16-2}" \
    GPUCR_E2E_BUDGET_S=${GPUCR_STORE_BUDGET_S:-270} OUT=$OUT/$mode \
    bash "$REPO/tests/gpu/h200-e2e.sh" >"$OUT/$mode.log" 2>&1
  echo "mode $mode: h200-e2e.sh exit $?" | tee -a "$SUM"
  cat "$OUT/$mode/results.txt" >>"$SUM" 2>/dev/null
  # The shim's own lines: what went to the store and what came back, with their times.
  if [ -f "$OUT/$mode/containerd.log.gz" ]; then
    zcat "$OUT/$mode/containerd.log.gz" | grep -E 'checkpoint by reference|back from the store|pulled from|"checkpointed"|msg="checkpointed|restored' \
      | sed 's/^/  /' | tail -20 >>"$SUM"
  fi
  # Allocated bytes: packs are sparse where their duplicate slices were punched.
  echo "  store after: $(du -s -B1 "$store" 2>/dev/null | cut -f1) bytes allocated, $(find "$store/chunks" -type f 2>/dev/null | wc -l) chunks and pointers, $(find "$store/packs" -type f 2>/dev/null | wc -l) packs" >>"$SUM"
  [ -f "$OUT/$mode/shared-read.txt" ] && sed 's/^/  /' "$OUT/$mode/shared-read.txt" >>"$SUM"
  rm -rf "$store" "${shared_dir:-/nonexistent}"
done
cat "$SUM"
