#!/usr/bin/env bash
# CRIU's pages cut by content against fixed 8 MiB slices (issue 22, docs/BENCHMARKS.md): a
# Python process (300 MB of bytes objects and 200,000 dicts) is dumped twice by CRIU
# (--leave-running), its heap grown between the dumps (50,000 dicts more, 3 MB inserted in its
# list); each dump is imported into one fresh store per way with `gpucr import`, and the
# second dump's new bytes are compared: the pages image under its own name (gpucr cuts
# `pages-*.img` by content) and the same bytes renamed (cut in fixed 8 MiB slices).
#   usage (root; criu and python3 on PATH): bash tests/store-cuts-bench.sh [GPUCR_BINARY]
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
gpucr=${1:-$repo/target/release/gpucr}
work=$(mktemp -d /dev/shm/gpucr-cuts.XXXXXX)
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
cat >"$work/w.py" <<'PY'
import os, sys, time
big = [os.urandom(1 << 20) for _ in range(300)]
objs = [dict(a=i, b=str(i) * 3) for i in range(200000)]
grow = sys.argv[1]
open(grow + ".ready", "w").close()
while True:
    if os.path.exists(grow):
        os.remove(grow)
        objs.extend(dict(a=i, b=str(i) * 5) for i in range(50000))
        big.insert(10, os.urandom(3 << 20))
        open(grow + ".grown", "w").close()
    time.sleep(0.05)
PY
setsid python3 "$work/w.py" "$work/grow" </dev/null >/dev/null 2>&1 &
pid=$!
while [ ! -e "$work/grow.ready" ]; do sleep 0.1; done
criu dump -t "$pid" -D "$(mkdir -p "$work/d1" && echo "$work/d1")" --shell-job --leave-running -o dump.log
touch "$work/grow"
while [ ! -e "$work/grow.grown" ]; do sleep 0.1; done
criu dump -t "$pid" -D "$(mkdir -p "$work/d2" && echo "$work/d2")" --shell-job --leave-running -o dump.log
kill "$pid"
for way in content fixed; do
  for d in d1 d2; do
    mkdir -p "$work/$way/$d"
    name=pages-1.img
    [ "$way" = fixed ] && name=pages-1.fixed
    cp "$work/$d/pages-1.img" "$work/$way/$d/$name"
    t0=$(date +%s%N)
    line=$(GPUCR_EVENT_LOG="$work/events" "$gpucr" --store "$work/$way/store" import --name "p/$d" "$work/$way/$d" | tail -1)
    echo "$way $d: ${line##*: } in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  done
done
