#!/usr/bin/env bash
# Two builds of gpucr side by side on one GPU machine, in one call: tests/gpu/h200-hook.sh
# (the hook's fast path on the host, then containers through gpucr with the hook) with the
# binaries of an earlier commit, then with this tree's, same settings, then the figures of
# both in one table. Issue 26 asks for it: a redesign that changes no behaviour keeps the
# fast path's figures within noise.
#
#   tests/gpu/prepare-carry.sh                          this tree's binaries -> carry/
#   tests/gpu/prepare-carry.sh --bin-only REV           REV's binaries -> carry-before/bin
#   device: bash tests/gpu/h200-ab.sh, carry ["carry", "carry-before"]
#
# GPUCR_AB_ORDER (default "before after"): the sides in the order they run; a side is a
#   directory carry-SIDE/bin ("after" is carry/bin). Each side runs h200-hook.sh with
#   GPUCR_AB_BUDGET_S seconds (default 270) and these defaults, which the caller may set:
#   GPUCR_HOOK_SIZES "1+15:driver,fast" (16 GiB: the driver alone, then the hook's cycle),
#   GPUCR_HOOK_OVERHEAD_ROUNDS 1, GPUCR_HOOK_E2E "c t" (a CUDA container and PyTorch's
#   training loop through ctr checkpoint/restore, every step checked against a reference).
#   Per side: GPUCR_AB_E2E_BEFORE, GPUCR_AB_E2E_AFTER ("" skips the containers part) and
#   GPUCR_AB_BUDGET_BEFORE_S, GPUCR_AB_BUDGET_AFTER_S.
# Results: $OUT/SIDE/ (h200-hook.sh's files), $OUT/ab-summary.txt (the table).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$REPO/ab-out}
mkdir -p "$OUT"
export GPUCR_HOOK_SIZES=${GPUCR_HOOK_SIZES:-1+15:driver,fast}
export GPUCR_HOOK_OVERHEAD_ROUNDS=${GPUCR_HOOK_OVERHEAD_ROUNDS:-1}
export GPUCR_HOOK_E2E=${GPUCR_HOOK_E2E-c t}
export GPUCR_E2E_SKIP_STOCK=1
per=${GPUCR_AB_BUDGET_S:-270}
[ -d "$REPO/carry/debs" ] || { echo "FATAL: carry/debs missing (tests/gpu/prepare-carry.sh)" >&2; exit 1; }
for side in ${GPUCR_AB_ORDER:-before after}; do
  bin=$REPO/carry-$side/bin
  [ "$side" = after ] && bin=$REPO/carry/bin
  [ -d "$bin" ] || { echo "side $side: $bin missing: SKIPPED" | tee -a "$OUT/ab-summary.txt"; continue; }
  # A carry folder of its own per side: that side's binaries, the shared packages, and
  # shim-ckpt (a test client, not the product) from carry/ when the side has none.
  c=/tmp/gpucr-ab-carry-$side
  rm -rf "$c"
  mkdir -p "$c/bin"
  ln -s "$REPO/carry/debs" "$c/debs"
  cp "$bin"/* "$c/bin/"
  [ -f "$c/bin/shim-ckpt" ] || cp "$REPO/carry/bin/shim-ckpt" "$c/bin/"
  echo "[$(date -u +%T)] side $side: $(ls "$c/bin" | tr '\n' ' ')"
  # Per side: GPUCR_AB_E2E_BEFORE / GPUCR_AB_E2E_AFTER (the containers part; "" skips it)
  # and GPUCR_AB_BUDGET_BEFORE_S / GPUCR_AB_BUDGET_AFTER_S, else the shared settings.
  side_uc=$(echo "$side" | tr 'a-z-' 'A-Z_')
  e2e_var=GPUCR_AB_E2E_$side_uc
  budget_var=GPUCR_AB_BUDGET_${side_uc}_S
  side_e2e=${!e2e_var-$GPUCR_HOOK_E2E}
  side_budget=${!budget_var:-$per}
  GPUCR_HOOK_E2E=$side_e2e GPUCR_E2E_CARRY=$c GPUCR_HOOK_BUDGET_S=$side_budget OUT=$OUT/$side \
    timeout -k 10 $((side_budget + 40)) bash "$REPO/tests/gpu/h200-hook.sh" >"$OUT/$side.log" 2>&1
  echo "[$(date -u +%T)] side $side: h200-hook.sh exit $?"
  # The e2e part removes its data; the images of the hook part are removed by the script.
done
python3 - "$OUT" ${GPUCR_AB_ORDER:-before after} <<'EOF' | tee -a "$OUT/ab-summary.txt"
import json, os, sys
out, sides = sys.argv[1], sys.argv[2:]
rows = {}
for s in sides:
    p = os.path.join(out, s, "hook-results.jsonl")
    for line in open(p) if os.path.exists(p) else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k.endswith(("_ms", "_gbps", "_mib")):
                rows.setdefault((r.get("label"), r.get("phase"), k), {})[s] = v
print("figure (label phase field)".ljust(44) + "".join(s.rjust(12) for s in sides) + "   ratio")
for (label, phase, k), v in rows.items():
    vals = [v.get(s) for s in sides]
    ratio = f"{vals[-1] / vals[0]:.2f}" if None not in vals and vals[0] else "-"
    print(f"{label} {phase} {k}".ljust(44) + "".join(("-" if x is None else str(x)).rjust(12) for x in vals) + "   " + ratio)
for s in sides:
    p = os.path.join(out, s, "results.txt")
    print(f"\ncontainers, {s}:")
    print(open(p).read().rstrip() if os.path.exists(p) else "  (no results.txt)")
EOF
