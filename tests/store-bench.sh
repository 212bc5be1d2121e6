#!/usr/bin/env bash
# By-reference checkpoints against containerd's tar, on this machine's CPUs (issue 22): one
# step per call, so that a timer can run two of them in turn.
#
#   tests/store-bench.sh prepare GIB   a checkpoint-like directory: pages-1.img (GIB GiB of
#                                      random bytes) and small CRIU files, in $BENCH_DIR
#                                      (default /dev/shm/gpucr-store-bench)
#   tests/store-bench.sh ingest        first checkpoint by reference: `gpucr import` of a
#                                      hard-linked copy into an empty store (hash + write)
#   tests/store-bench.sh reingest      second checkpoint of unchanged memory: the same into a
#                                      store that holds it (hash only, nothing written)
#   tests/store-bench.sh written-once  the hook's write and the store taking it in place: the
#                                      image copied into a fresh directory on the store's
#                                      filesystem (what the hook writes into its stage), then
#                                      `gpucr import` of it into an empty store (hash + link)
#   tests/store-bench.sh written-twice the same write, then the import copying it (hash +
#                                      write: a second name on each file makes it copy), as
#                                      before packs
#   tests/store-bench.sh tar           what containerd does with an inline image: one tar
#                                      stream through SHA-256 into a blob
#   tests/store-bench.sh export        restore by reference: `gpucr export` (files back from
#                                      the store at their offsets)
#   tests/store-bench.sh untar         containerd's unpack of that blob for the restore
#
# GPUCR_CLI: the gpucr binary (default target/release/gpucr). Pairs, e.g.:
#   for i in 1 2 3 4 5; do /usr/bin/time -f "ingest %e" tests/store-bench.sh ingest;
#     /usr/bin/time -f "tar %e" tests/store-bench.sh tar; done
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
B=${BENCH_DIR:-/dev/shm/gpucr-store-bench}
CLI=${GPUCR_CLI:-$REPO/target/release/gpucr}
case ${1:-} in
  prepare)
    rm -rf "$B"
    mkdir -p "$B/src"
    head -c "$((${2:-2} << 30))" /dev/urandom >"$B/src/pages-1.img"
    for f in inventory core-1 mm-1 pagemap-1 files; do head -c 4096 /dev/urandom >"$B/src/$f.img"; done
    # The reference store (for reingest and export) and the tar blob (for untar).
    cp -al "$B/src" "$B/seed"
    "$CLI" --store "$B/store" import "$B/seed" --name bench/seed >/dev/null
    tar -C "$B/src" -cf "$B/blob.tar" .
    ;;
  ingest)
    rm -rf "$B/w" "$B/fresh"
    cp -al "$B/src" "$B/w"
    "$CLI" --store "$B/fresh" import "$B/w" --name bench/1 >/dev/null
    ;;
  written-once)
    rm -rf "$B/w" "$B/fresh"
    cp -a "$B/src" "$B/w"
    "$CLI" --store "$B/fresh" import "$B/w" --name bench/1 >/dev/null
    ;;
  written-twice)
    rm -rf "$B/w" "$B/w2" "$B/fresh"
    cp -a "$B/src" "$B/w"
    cp -al "$B/w" "$B/w2"
    "$CLI" --store "$B/fresh" import "$B/w2" --name bench/1 >/dev/null
    ;;
  reingest)
    rm -rf "$B/w"
    cp -al "$B/src" "$B/w"
    "$CLI" --store "$B/store" import "$B/w" --name "bench/$(date +%s%N)" >/dev/null
    ;;
  tar)
    tar -C "$B/src" -cf - . | tee "$B/out.tar" | sha256sum >/dev/null
    ;;
  export)
    rm -rf "$B/x"
    cp -a "$B/seed" "$B/x"
    "$CLI" --store "$B/store" export "$B/x" >/dev/null
    ;;
  untar)
    rm -rf "$B/u"
    mkdir -p "$B/u"
    tar -C "$B/u" -xf "$B/blob.tar"
    ;;
  *)
    echo "usage: $0 prepare GIB | ingest | written-once | written-twice | reingest | tar | export | untar" >&2
    exit 2
    ;;
esac
