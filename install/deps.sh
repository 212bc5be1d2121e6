#!/usr/bin/env bash
# Installs gpucr's runtime dependencies on Debian/Ubuntu: containerd, runc, iptables, CRIU >= 4,
# and busybox-static (the tests build their images from it; no registry is needed).
# Debian 12's CRIU 3.17 cannot run on recent kernels (vDSO bounds), so CRIU comes from Debian
# trixie where the base is older; an apt pin keeps every other package on the base release.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

need_trixie=0
if [ -r /etc/os-release ]; then
  . /etc/os-release
  if [ "${ID:-}" = debian ] && [ "${VERSION_ID:-0}" -lt 13 ] 2>/dev/null; then need_trixie=1; fi
fi

if [ "$need_trixie" = 1 ] && ! grep -rqs 'trixie' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  echo "gpucr: adding Debian trixie (pinned low) for CRIU >= 4, containerd 1.7 and runc"
  cat >/etc/apt/sources.list.d/gpucr-trixie.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  cat >/etc/apt/preferences.d/gpucr-trixie <<'PIN'
Package: *
Pin: release n=trixie
Pin-Priority: 100
PIN
fi

apt-get update -qq
pkgs=(containerd runc criu iptables)
if [ "$need_trixie" = 1 ]; then
  apt-get install -y -qq -t trixie "${pkgs[@]}"
else
  apt-get install -y -qq "${pkgs[@]}"
fi
# busybox-static from the base release: trixie's busybox 1.37 mis-restarts `sleep` after CRIU.
apt-get install -y -qq busybox-static jq >/dev/null
criu --version
containerd --version
runc --version | head -1
