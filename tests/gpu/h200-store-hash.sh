#!/usr/bin/env bash
# How many threads the store's adoption (hash every 8 MiB slice in place, a pointer per new
# one) wants on the GPU machine: `gpucr import` of one 16 GiB file on /dev/shm into an empty
# store there, once per thread count, twice each (issue 22; by_reference::take_ahead's choice).
#   carry ["carry-bench"] (gpucr.xz: target/release/gpucr, stripped, xz): bash tests/gpu/h200-store-hash.sh
# The file is a 256 MiB random block repeated (so 32 slices are new, the rest duplicates:
# BLAKE3 over every byte either way). GPUCR_HASH_THREADS (default "4 8 12 15 16"), GPUCR_HASH_GIB (16).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
W=/dev/shm/gpucr-hash
rm -rf "$W"; mkdir -p "$W"
python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
  "${GPUCR_HASH_CARRY:-$REPO/carry-bench}/gpucr.xz" "$W/gpucr"
chmod +x "$W/gpucr"
head -c $((256 << 20)) /dev/urandom >"$W/block"
gib=${GPUCR_HASH_GIB:-16}
echo "$(date -u +%FT%TZ) $(nproc) CPUs; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2); ${gib} GiB file"
for round in 1 2; do
  for t in ${GPUCR_HASH_THREADS:-4 8 12 15 16}; do
    rm -rf "$W/store" "$W/dir"; mkdir -p "$W/dir"
    for _ in $(seq $((gib * 4))); do cat "$W/block"; done >"$W/dir/data.bin"
    t0=$(date +%s%N)
    "$W/gpucr" --store "$W/store" import "$W/dir" --name bench/$t --threads "$t" >/dev/null
    echo "round $round threads $t: $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  done
done
rm -rf "$W"
