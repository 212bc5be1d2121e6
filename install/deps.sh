#!/usr/bin/env bash
# Installs gpucr's runtime dependencies on Debian 12/13 and Ubuntu 22.04/24.04 without changing
# any package that is already installed: containerd >= 1.7, runc, iptables, CRIU >= 4,
# busybox-static (the tests build their images from it; no registry is needed) and jq.
#
# - Every apt install is simulated first and refused if it would upgrade, downgrade or remove
#   an installed package (see gpucr_apt_install_new in lib.sh). All use --no-install-recommends
#   (containerd recommends the release's CRIU, which is too old on Debian 12).
# - Debian 12: containerd 1.7 from Debian trixie (an apt source pinned at priority 100, so
#   nothing else ever comes from it; trixie's containerd needs only libc6 >= 2.34), runc and
#   iptables from bookworm. trixie's runc/criu/iptables need a newer libc6: never taken.
# - Where the release's CRIU is older than 4 (Debian 12: 3.17, which fails on recent kernels)
#   CRIU 4.1.1 is built from Debian's orig tarball (checksum checked) into /usr/local/sbin/criu,
#   with its plugin directory set to /usr/lib/criu (where install.sh puts gpucr's plugin).
#   Its build dependencies are installed from the release (new packages only) and left there.
# - What it installed is listed in /var/lib/gpucr/deps-packages and /var/lib/gpucr/deps-files.
#
# usage: install/deps.sh        (as root, or a user with sudo)
# env:   GPUCR_CRIU_TARBALL     a local copy of criu_4.1.1.orig.tar.xz (no download then)
#        GPUCR_CRIU_URL         where to download it (default: deb.debian.org's pool)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
gpucr_tag=gpucr-deps
# shellcheck source=install/lib.sh
. "$here/lib.sh"
gpucr_as_root "$here/deps.sh" "$@"
export DEBIAN_FRONTEND=noninteractive

criu_version=4.1.1
criu_sha256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
criu_url=${GPUCR_CRIU_URL:-http://deb.debian.org/debian/pool/main/c/criu/criu_${criu_version}.orig.tar.xz}
criu_bin=/usr/local/sbin/criu
criu_build_deps=(build-essential pkg-config libbsd-dev libcap-dev libgnutls28-dev libnet1-dev
  libnftables-dev libnl-3-dev libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler
  protobuf-compiler uuid-dev python3-protobuf)

[ -r /etc/os-release ] || gpucr_die "no /etc/os-release: supported are Debian 12/13 and Ubuntu 22.04/24.04"
. /etc/os-release
release="${ID:-?} ${VERSION_ID:-?}"
# containerd_from: the apt release containerd comes from ("" = the base release).
containerd_from=""
case "$release" in
  "debian 12") containerd_from=trixie ;;
  "debian 13") ;;
  "ubuntu 22.04" | "ubuntu 24.04") gpucr_say "NOTE: $release support is written but untested" ;;
  *) gpucr_die "unsupported release '$release' (${PRETTY_NAME:-}); supported: Debian 12/13, Ubuntu 22.04/24.04. Install containerd >= 1.7, runc, iptables, CRIU >= 4, busybox-static and jq yourself, then run install/install.sh --no-deps" ;;
esac
gpucr_say "release: ${PRETTY_NAME:-$release}"

if [ "$containerd_from" = trixie ]; then
  # A low-priority trixie source: only packages asked for as pkg/trixie come from it.
  # tests/gpu/prepare-carry.sh also downloads .debs from it.
  if ! grep -rqsE '^[^#]*\btrixie\b' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    gpucr_say "adding apt source /etc/apt/sources.list.d/gpucr-trixie.sources (Debian trixie, pinned at 100 in /etc/apt/preferences.d/gpucr-trixie: only containerd is taken from it)"
    cat >/etc/apt/sources.list.d/gpucr-trixie.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  fi
  if [ ! -f /etc/apt/preferences.d/gpucr-trixie ]; then
    cat >/etc/apt/preferences.d/gpucr-trixie <<'PIN'
# gpucr (install/deps.sh): never take anything from trixie unless asked for by name.
Package: *
Pin: release n=trixie
Pin-Priority: 100
PIN
  fi
fi

gpucr_say "apt-get update"
apt-get update -qq

# containerd >= 1.7: keep an installed one; refuse an installed older one (upgrading it is the
# operator's decision, not ours).
have=$(gpucr_dpkg_version containerd)
if [ -z "$have" ] && command -v containerd >/dev/null 2>&1; then
  have=$(containerd --version | awk '{print $3}' | sed 's/^v//')
  gpucr_say "containerd $have is installed, not from the containerd package ($(command -v containerd), e.g. Docker's containerd.io); keeping it"
fi
if [ -n "$have" ]; then
  dpkg --compare-versions "$have" ge 1.7 \
    || gpucr_die "containerd $have is installed; gpucr needs >= 1.7. Upgrade it yourself (deps.sh changes no installed package), then re-run"
else
  # runc first, from the base release, so containerd/trixie does not pull trixie's.
  command -v runc >/dev/null 2>&1 || gpucr_apt_install_new runc
  if [ -n "$containerd_from" ]; then
    gpucr_apt_install_new "containerd/$containerd_from"
  else
    cand=$(gpucr_apt_candidate containerd)
    [ -n "$cand" ] && dpkg --compare-versions "$cand" ge 1.7 \
      || gpucr_die "this release's containerd is '${cand:-none}'; gpucr needs >= 1.7 (on Ubuntu 22.04 enable jammy-updates). Install containerd yourself, then re-run"
    gpucr_apt_install_new containerd
  fi
fi
# A runc or iptables already there (e.g. Docker's containerd.io brings runc) is kept.
rest=(busybox-static jq)
command -v runc >/dev/null 2>&1 || rest+=(runc)
PATH="$PATH:/usr/sbin:/sbin" command -v iptables >/dev/null 2>&1 || rest+=(iptables)
gpucr_apt_install_new "${rest[@]}"

# CRIU >= 4, with its plugin directory /usr/lib/criu.
criu_major() { "$1" --version 2>/dev/null | awk '/^Version:/ {split($2, v, "."); print v[1]}'; }
criu_ok() { [ -x "$1" ] && [ "$(criu_major "$1")" -ge 4 ] 2>/dev/null; }
# The compiled-in plugin directory must be /usr/lib/criu (captured first: grep -q would cut
# the pipe and fail it under pipefail).
criu_plugins_usr_lib() { local h; h=$("$1" --help 2>&1 || true); [[ $h == *"(by default /usr/lib/criu"* ]]; }
installed_criu=$(gpucr_dpkg_version criu)
if criu_ok "$criu_bin" && criu_plugins_usr_lib "$criu_bin"; then
  gpucr_say "CRIU: $criu_bin is $("$criu_bin" --version | head -1) already; not rebuilding"
elif [ -n "$installed_criu" ] && dpkg --compare-versions "$installed_criu" ge 4; then
  gpucr_say "CRIU: package criu $installed_criu is installed; keeping it"
elif cand=$(gpucr_apt_candidate criu) && [ -n "$cand" ] && dpkg --compare-versions "$cand" ge 4; then
  gpucr_apt_install_new criu
else
  if [ -n "$installed_criu" ]; then
    gpucr_say "NOTE: package criu $installed_criu stays installed (/usr/sbin/criu); $criu_bin comes first on PATH"
  fi
  gpucr_say "CRIU: this release has ${cand:-no} criu (< 4): building CRIU $criu_version from source into $criu_bin"
  work=$(mktemp -d /var/tmp/gpucr-criu-build.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  # A -dev package pins its runtime library's exact version: on a host whose libraries are
  # older than the mirror's (e.g. libcap2), installing it would upgrade that library. Those are
  # unpacked into a private sysroot for this build only (same upstream version, headers and
  # link symlinks) and the build links against the installed library.
  installable=() private=()
  for p in "${criu_build_deps[@]}"; do
    if gpucr_apt_would_change "$p"; then
      case "$p" in
        *-dev) private+=("$p") ;;
        *) gpucr_die "CRIU build dependency $p cannot be installed without changing installed packages (apt-get install -s $p shows which); install it yourself, or CRIU >= 4, then re-run" ;;
      esac
    else
      installable+=("$p")
    fi
  done
  gpucr_say "CRIU build dependencies (from the release):"
  gpucr_apt_install_new "${installable[@]}"
  build_env=()
  if [ "${#private[@]}" -gt 0 ]; then
    gpucr_say "unpacked for the build only, into $work/sysroot (installing them would upgrade an installed library): ${private[*]}"
    mkdir -p "$work/debs" "$work/sysroot"
    (cd "$work/debs" && apt-get download -qq -o APT::Sandbox::User=root "${private[@]}")
    for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$work/sysroot"; done
    ma=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
    # Repoint lib*.so -> lib*.so.N (not unpacked) at the installed runtime library.
    for link in "$work/sysroot/usr/lib/$ma"/*.so; do
      [ -L "$link" ] && [ ! -e "$link" ] || continue
      target=$(basename "$(readlink "$link")")
      for dir in "/usr/lib/$ma" "/lib/$ma"; do
        if [ -e "$dir/$target" ]; then ln -sf "$dir/$target" "$link"; break; fi
      done
      [ -e "$link" ] || gpucr_die "$(basename "$link") -> $target: the runtime library is not installed"
    done
    build_env=(CPATH="$work/sysroot/usr/include" LIBRARY_PATH="$work/sysroot/usr/lib/$ma")
  fi
  tarball="$work/criu_${criu_version}.orig.tar.xz"
  if [ -n "${GPUCR_CRIU_TARBALL:-}" ]; then
    cp "$GPUCR_CRIU_TARBALL" "$tarball"
  else
    gpucr_say "downloading $criu_url"
    # apt's own downloader: present wherever apt is (no curl/wget needed).
    /usr/lib/apt/apt-helper -o APT::Sandbox::User=root download-file "$criu_url" "$tarball" "SHA256:$criu_sha256" >/dev/null \
      || gpucr_die "could not download $criu_url; download it elsewhere and pass GPUCR_CRIU_TARBALL=/path/to/it"
  fi
  echo "$criu_sha256  $tarball" | sha256sum -c --quiet - \
    || gpucr_die "$tarball: sha256 is not $criu_sha256; refusing to build it"
  tar -xJf "$tarball" -C "$work"
  src="$work/criu-$criu_version"
  gpucr_say "building CRIU (make criu, about a minute on 2 cores; log: $work/build.log)"
  # PLUGINDIR is compiled in as the default --libdir: keep Debian's /usr/lib/criu (not
  # $PREFIX/lib/criu), where install.sh puts gpucr_cuda_plugin.so.
  if ! env "${build_env[@]}" make -C "$src" -j"$(nproc)" PREFIX=/usr/local PLUGINDIR=/usr/lib/criu criu >"$work/build.log" 2>&1; then
    tail -40 "$work/build.log" >&2
    trap - EXIT
    gpucr_die "building CRIU failed (log kept: $work/build.log)"
  fi
  install -D -m 0755 "$src/criu/criu" "$criu_bin"
  criu_plugins_usr_lib "$criu_bin" \
    || gpucr_die "$criu_bin does not default to plugin directory /usr/lib/criu"
  mkdir -p "$gpucr_state_dir"
  sed -i "\#^$criu_bin #d" "$gpucr_state_dir/deps-files" 2>/dev/null || true
  echo "$criu_bin built-from criu_${criu_version}.orig.tar.xz sha256:$criu_sha256" >> "$gpucr_state_dir/deps-files"
  gpucr_say "installed $criu_bin ($("$criu_bin" --version | head -1)), plugins from /usr/lib/criu"
fi

gpucr_say "in place:"
criu_path=$(PATH="/usr/local/sbin:/usr/sbin:/sbin:$PATH" command -v criu)
echo "    containerd $(containerd --version | awk '{print $3}') ($(command -v containerd))"
echo "    runc $(runc --version | awk 'NR==1 {print $3}') ($(command -v runc))"
echo "    criu $("$criu_path" --version | awk '/^Version:/ {print $2}') ($criu_path)"
echo "    iptables $(iptables --version | awk '{print $2, $3}') ($(command -v iptables))"
echo "    busybox-static $(gpucr_dpkg_version busybox-static), jq $(gpucr_dpkg_version jq)"
if ! "$criu_path" check >/dev/null 2>&1; then
  gpucr_say "WARNING: 'criu check' fails on this kernel; checkpoints will fail. Its output:"
  "$criu_path" check || true
fi
