#!/usr/bin/env bash
# The gpucr demo on a fresh Debian/Ubuntu machine: install everything, start containerd,
# run a container with gpucr, checkpoint it, kill it, restore it, and show its in-memory
# counter going on from where it was.
#
# usage: bash install/demo.sh [--no-install]   (as root, or as a user with sudo: it re-runs
#        itself with sudo; cargo is found in ~/.cargo/bin of the user who ran sudo)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
gpucr_tag=gpucr-demo
# shellcheck source=install/lib.sh
. "$here/lib.sh"
gpucr_as_root "$here/demo.sh" "$@"
[ "${1:-}" = --no-install ] || bash "$here/install.sh"

sock=/run/containerd/containerd.sock
if ! ctr -a "$sock" version >/dev/null 2>&1; then
  echo "demo: starting containerd (log: /var/log/gpucr-demo-containerd.log)"
  nohup containerd >/var/log/gpucr-demo-containerd.log 2>&1 &
  for _ in $(seq 100); do ctr -a "$sock" version >/dev/null 2>&1 && break; sleep 0.1; done
fi
ctr="ctr -a $sock -n gpucr-demo"
image=$("$here/busybox-image.sh" docker.io/library/busybox:gpucr -a "$sock" -n gpucr-demo)
id=gpucr-demo-$$
ref=docker.io/gpucr/demo-checkpoint:$$

# The counter lives in the shell's memory; each tick overwrites /tmp/count just to show it.
$ctr run -d --runtime io.containerd.gpucr.v2 --net-host "$image" "$id" \
  sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done' >/dev/null
count() { $ctr task exec --exec-id "show-$RANDOM" "$id" cat /tmp/count; }
sleep 3
before=$(count)
echo "demo: container $id counts in memory: $before; checkpointing it with gpucr"
t0=$(date +%s%N)
$ctr container checkpoint --task --rw "$id" "$ref"
t1=$(date +%s%N)
$ctr task kill -s KILL "$id"
for _ in $(seq 50); do $ctr task delete "$id" >/dev/null 2>&1 && break; sleep 0.1; done
$ctr container delete "$id"
echo "demo: checkpointed in $(( (t1 - t0) / 1000000 )) ms; container killed and removed; restoring"
t2=$(date +%s%N)
$ctr container restore --live --rw "$id" "$ref"
t3=$(date +%s%N)
sleep 1
after=$(count)
echo "demo: restored in $(( (t3 - t2) / 1000000 )) ms; the counter went on: $before -> $after"
$ctr task kill -s KILL "$id" >/dev/null 2>&1 || true
for _ in $(seq 50); do $ctr task delete "$id" >/dev/null 2>&1 && break; sleep 0.1; done
$ctr container delete "$id" >/dev/null 2>&1 || true
$ctr image rm --sync "$ref" >/dev/null 2>&1 || true
if [ "$after" -gt "$before" ]; then echo "demo: OK"; else echo "demo: FAILED (counter did not go on)"; exit 1; fi
