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
# (per side, default 270). GPUCR_STORE_64 (e.g. "local"): after those, these modes once more with
# 64 GiB (GPUCR_STORE_64_GIB) and one cycle (twice-64 only: the node's tmpfs holds one such
# checkpoint; inline needs the image three times over, in containerd's content store, the
# checkpoint directory and its unpacked copy, more than the machine's memory and disk).
# Results: $OUT/MODE/ and $OUT/MODE-64/ (h200-e2e.sh's files), $OUT/store-summary.txt.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$REPO/store-out}
mkdir -p "$OUT"
SUM=$OUT/store-summary.txt
: >"$SUM"
export GPUCR_E2E_SKIP_STOCK=1
# side MODE NAME SCENARIOS GIB: h200-e2e.sh with that store mode into $OUT/NAME.
side() {
  local mode=$1 name=$2 scenarios=$3 gib=$4
  local store=/dev/shm/gpucr-store-$mode shared_dir="" wipe=""
  rm -rf "$store"
  echo "[$(date -u +%T)] mode $mode ($name, $gib GiB): store $store" | tee -a "$SUM"
  if [ "$mode" = shared ]; then
    shared_dir=/dev/shm/gpucr-shared
    rm -rf "$shared_dir"
    mkdir -p "$shared_dir" "$OUT/$name"
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
echo "shared store read: \$bytes bytes in \$ms ms (\$(awk -v b=\$bytes -v m=\$ms 'BEGIN {printf "%.1f", b/1e6/(m>0?m:1)}') GB/s)" >>"$OUT/$name/shared-read.txt"
WIPE
    chmod +x "$wipe"
  fi
  GPUCR_STORE=$store GPUCR_STORE_MODE=$mode GPUCR_STORE_SHARED=$shared_dir CR_BEFORE_RESTORE=$wipe \
    GPUCR_E2E_ONLY="$scenarios" GPUCR_E2E_BIG_GIB=$gib \
    GPUCR_E2E_BUDGET_S=${GPUCR_STORE_BUDGET_S:-270} OUT=$OUT/$name \
    bash "$REPO/tests/gpu/h200-e2e.sh" >"$OUT/$name.log" 2>&1
  echo "mode $mode: h200-e2e.sh exit $?" | tee -a "$SUM"
  cat "$OUT/$name/results.txt" >>"$SUM" 2>/dev/null
  # The shim's own lines: what went to the store and what came back, with their times.
  if [ -f "$OUT/$name/containerd.log.gz" ]; then
    zcat "$OUT/$name/containerd.log.gz" | grep -E 'checkpoint by reference|during the dump|back from the store|pulled from|verified|planned restore|"checkpointed"|msg="checkpointed|restored' \
      | grep -v 'percent=' | sed 's/^/  /' | tail -40 >>"$SUM"
  fi
  # Allocated bytes: packs are sparse where their duplicate slices were punched.
  echo "  store after: $(du -s -B1 "$store" 2>/dev/null | cut -f1) bytes allocated, $(find "$store/chunks" -type f 2>/dev/null | wc -l) chunks and pointers, $(find "$store/packs" -type f 2>/dev/null | wc -l) packs" >>"$SUM"
  [ -f "$OUT/$name/shared-read.txt" ] && sed 's/^/  /' "$OUT/$name/shared-read.txt" >>"$SUM"
  rm -rf "$store" "${shared_dir:-/nonexistent}"
}
for mode in ${GPUCR_STORE_SIDES:-inline local}; do
  side "$mode" "$mode" "${GPUCR_STORE_SCENARIOS:-twice-16 twice-16-2}" "${GPUCR_E2E_BIG_GIB:-16}"
done
for mode in ${GPUCR_STORE_64:-}; do
  side "$mode" "$mode-64" "twice-${GPUCR_STORE_64_GIB:-64}" "${GPUCR_STORE_64_GIB:-64}"
done
cat "$SUM"
