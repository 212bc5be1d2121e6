#!/usr/bin/env bash
# Prepares carry/ for the GPU end-to-end run (tests/gpu/h200-e2e.sh) on a CPU machine with apt:
#   carry/debs/  Debian .deb files the GPU machine lacks: containerd 1.7, runc 1.1, CRIU 4.1 and
#                its libraries (trixie), busybox-static 1.35 (bookworm: trixie's 1.37 mis-restarts
#                `sleep` after CRIU)
#   carry/bin/   containerd-shim-gpucr-v2, libgpucr_criu_plugin.so, libgpucr_hook.so and shim-ckpt
#                (release builds; shim-ckpt: h200-e2e.sh's scenario s)
# usage: tests/gpu/prepare-carry.sh [--no-build] [--cri] [--bin-into DIR]
#   --cri  for tests/gpu/h200-cri.sh instead: containerd 2.x (Debian sid's) and checkpointctl
#          (trixie's) in place of containerd 1.7, both from tests/containerd2.sh's download
#          directory (run it first), and the cri-gpu driver in carry/bin (xz)
#   --bin-into DIR  only the product's binaries (shim, CRIU plugin, hook, gpucr-copyin) into
#          DIR/bin, nothing else: another build's side for tests/gpu/h200-ab.sh, e.g.
#          CARGO_TARGET_DIR=/work/before-target prepare-carry.sh --no-build --bin-into carry-before
# The release binaries come from $CARGO_TARGET_DIR/release (default target/release); they are
# built first unless --no-build is given. carry/ is git-ignored; the device tool takes it along
# when `carry` names it. Needs apt sources for trixie (see install/deps.sh) and bookworm.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
build=1
cri=0
bin_into=""
while [ $# -gt 0 ]; do
  case $1 in
    --no-build) build=0 ;;
    --cri) cri=1 ;;
    --bin-into) bin_into=${2:?--bin-into needs a directory}; shift ;;
    *) echo "usage: $0 [--no-build] [--cri] [--bin-into DIR]" >&2; exit 2 ;;
  esac
  shift
done

# Packages that run on the GPU machine when extracted with dpkg -x (see shared/notes/gpu-facts.md).
trixie_pkgs=(
  containerd runc criu
  libcompel1 libprotobuf-c1 libnl-3-200 libnet1 libnftables1 libnftnl11 libmnl0 libjansson4
  libxtables12 libedit2 libbsd0 libgnutls30t64 libnettle8t64 libhogweed6t64 libunistring5
  libp11-kit0 libtasn1-6 libidn2-0 libgmp10 libmd0 libffi8
)
limit_mib=63   # the device tool carries 64 MiB in all, the working tree included

git check-ignore -q carry/ || { echo "error: carry/ is not git-ignored (add /carry to .gitignore)" >&2; exit 1; }

target=${CARGO_TARGET_DIR:-$repo/target}
if [ "$build" = 1 ]; then
  echo "== cargo build --release (target dir $target)"
  CARGO_TARGET_DIR=$target cargo build --release -p containerd-shim-gpucr-v2 -p gpucr-criu-plugin -p gpucr-hook-preload
  CARGO_TARGET_DIR=$target cargo build --release -p gpucr-tests --bin shim-ckpt --bin cri-gpu
fi
product_bins=(containerd-shim-gpucr-v2 libgpucr_criu_plugin.so libgpucr_hook.so gpucr-copyin)
if [ -n "$bin_into" ]; then
  git check-ignore -q "$bin_into/" || { echo "error: $bin_into/ is not git-ignored" >&2; exit 1; }
  rm -rf "$bin_into/bin"
  mkdir -p "$bin_into/bin"
  for b in "${product_bins[@]}"; do
    [ -f "$target/release/$b" ] || { echo "error: $target/release/$b missing" >&2; exit 1; }
    cp "$target/release/$b" "$bin_into/bin/"
  done
  strip "$bin_into"/bin/* 2>/dev/null || true
  xz -T0 -6 -f "$bin_into/bin/containerd-shim-gpucr-v2"
  ls -l "$bin_into/bin"
  exit 0
fi
if [ "$cri" = 1 ]; then
  # containerd 2.x in place of 1.7: the device tool's 64 MiB do not hold both.
  trixie_pkgs=("${trixie_pkgs[@]/containerd}")
fi

rm -rf carry/debs carry/bin
mkdir -p carry/debs carry/bin

echo "== apt-get download (trixie): ${trixie_pkgs[*]}"
( cd carry/debs && apt-get download -t trixie ${trixie_pkgs[*]} )
if [ "$cri" = 1 ]; then
  c2debs=${GPUCR_CONTAINERD2_DEBS:-/opt/gpucr-test/apt/debs}
  for p in containerd checkpointctl; do
    deb=$(ls -t "$c2debs"/${p}_*.deb 2>/dev/null | head -1)
    [ -n "$deb" ] || { echo "error: no ${p} .deb in $c2debs: run tests/containerd2.sh first" >&2; exit 1; }
    cp "$deb" carry/debs/
  done
fi

# busybox-static from bookworm: pick the newest 1.35 version apt knows.
bb_version=$(apt-cache madison busybox-static | awk -F'|' '{gsub(/ /,"",$2); print $2}' | grep -m1 '1\.35\.' || true)
[ -n "$bb_version" ] || { echo "error: apt knows no busybox-static 1.35 (bookworm); is bookworm in the apt sources?" >&2; exit 1; }
echo "== apt-get download busybox-static=$bb_version"
( cd carry/debs && apt-get download "busybox-static=$bb_version" )

for p in ${trixie_pkgs[*]} busybox-static; do
  ls carry/debs/"${p}"_*.deb >/dev/null 2>&1 || { echo "error: no .deb for $p in carry/debs" >&2; exit 1; }
done

for f in "$target/release/containerd-shim-gpucr-v2" "$target/release/libgpucr_criu_plugin.so" \
  "$target/release/libgpucr_hook.so" "$target/release/shim-ckpt" "$target/release/gpucr-copyin"; do
  [ -f "$f" ] || { echo "error: $f missing: build with cargo build --release -p containerd-shim-gpucr-v2 -p gpucr-criu-plugin -p gpucr-hook-preload and -p gpucr-tests --bin shim-ckpt" >&2; exit 1; }
  cp "$f" carry/bin/
done
strip carry/bin/* 2>/dev/null || true
# The shim is the largest file; compressed, everything fits the device tool's 64 MiB
# (h200-e2e.sh unpacks it with python3's lzma).
xz -T0 -6 -f carry/bin/containerd-shim-gpucr-v2
if [ "$cri" = 1 ]; then
  cp "$target/release/cri-gpu" carry/bin/
  strip carry/bin/cri-gpu 2>/dev/null || true
  xz -T0 -6 -f carry/bin/cri-gpu
  rm -f carry/bin/shim-ckpt
fi

echo "== carry/"
ls -l carry/debs carry/bin
carry_kib=$(du -sk carry | cut -f1)
# What else travels: tracked and untracked-not-ignored files (shared/ too, where there is one).
tree_kib=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {printf "%d", s / 1024}')
echo "carry/: $((carry_kib / 1024)) MiB; working tree: $((tree_kib / 1024)) MiB; together at most ${limit_mib} MiB (the device tool takes 64)"
if [ $((carry_kib + tree_kib)) -gt $((limit_mib * 1024)) ]; then
  echo "error: carry/ plus the working tree is over ${limit_mib} MiB" >&2
  exit 1
fi
if [ "$cri" = 1 ]; then
  echo "ok: run on the GPU machine with carry=[\"carry\"]: bash tests/gpu/h200-cri.sh"
else
  echo "ok: run on the GPU machine with carry=[\"carry\"]: bash tests/gpu/h200-e2e.sh"
fi
