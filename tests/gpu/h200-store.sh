#!/usr/bin/env bash
# Checkpoints by reference on the GPU machine (issue 22), in one call: h200-e2e.sh's
# scenarios (default twice-16 twice-16-2: a 16 GiB CUDA container with the hook, two
# `ctr c checkpoint --task --rw` / `ctr c restore --live --rw` cycles, every step checked
# against an uninterrupted run) once per store mode, side by side: inline (the image
# self-contained, through containerd's tar) and local (its large files in the node's store,
# on tmpfs; the second checkpoint writes only the chunks that changed).
#
#   tests/gpu/prepare-carry.sh; device: bash tests/gpu/h200-store.sh, carry ["carry"]
#
# GPUCR_STORE_SIDES (default "inline local"), GPUCR_STORE_SCENARIOS, GPUCR_STORE_BUDGET_S
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
  GPUCR_STORE=$store GPUCR_STORE_MODE=$mode \
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
  echo "  store after: $(du -sb "$store" 2>/dev/null | cut -f1) bytes in $(find "$store/chunks" -type f 2>/dev/null | wc -l) chunks" >>"$SUM"
  rm -rf "$store"
done
cat "$SUM"
