#!/usr/bin/env bash
# containerd 2.x and checkpointctl beside the node's containerd 1.7, for the tests (issue #21),
# without touching the node: no apt source, no package, nothing under /etc or /usr changes.
#
#   tests/containerd2.sh [PREFIX]     (default /opt/gpucr-test)
#
# 1. A private apt state (sources, lists, cache under PREFIX/apt) lists Debian sid and trixie
#    from deb.debian.org; `apt-get download` fetches sid's containerd (2.x) and trixie's
#    checkpointctl (1.3.0) and libc6 (2.41).
# 2. `dpkg -x` unpacks them: PREFIX/containerd2/usr/bin/{containerd,ctr,containerd-shim-runc-v2},
#    PREFIX/checkpointctl/usr/bin/checkpointctl, PREFIX/libc6/.
# 3. checkpointctl needs glibc 2.38 (Debian 12 has 2.36, and `apt-get install checkpointctl`
#    would upgrade libc6 and base-files): PREFIX/bin/checkpointctl runs it through trixie's own
#    dynamic loader with trixie's libc. containerd 2.x needs only glibc 2.34 and runs as is.
# 4. It checks that both run (`containerd --version` says 2., `checkpointctl --help`) and prints
#    the paths the tests take: GPUCR_TEST_CONTAINERD2=PREFIX/containerd2/usr/bin/containerd and
#    GPUCR_CHECKPOINTCTL=PREFIX/bin/checkpointctl.
# Idempotent: a second run with the same versions downloads and changes nothing.
set -euo pipefail
prefix=${1:-/opt/gpucr-test}
mirror=${GPUCR_DEBIAN_MIRROR:-http://deb.debian.org/debian}
say() { echo "containerd2.sh: $*"; }
die() { echo "containerd2.sh: ERROR: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (it writes $prefix)"
[ "$(dpkg --print-architecture)" = amd64 ] || die "only amd64 is set up here"

apt_dir=$prefix/apt
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs"
cat > "$apt_dir/sources.list" <<EOF
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror sid main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main
EOF
# Nothing of the node's apt configuration is read or written: own sources, lists, cache,
# no preferences (so `pkg/suite` picks the suite), no sandbox user for the downloads.
apt_opts=(
  -o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null
  -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
  -o Acquire::Languages=none -o APT::Sandbox::User=root
)
# Lists older than a day are refreshed; apt itself keeps them when nothing changed.
if [ -z "$(find "$apt_dir/lists" -maxdepth 1 -name '*sid_InRelease' -mmin -1440 2>/dev/null)" ]; then
  say "apt-get update (private lists in $apt_dir)"
  apt-get "${apt_opts[@]}" -qq update
fi

version_of() { apt-cache "${apt_opts[@]}" show "$1/$2" 2>/dev/null | awk '/^Version:/ {print $2; exit}'; }
# Downloads PKG from SUITE and unpacks it into DEST (once per version).
fetch_unpack() {
  local pkg=$1 suite=$2 dest=$3 version deb
  version=$(version_of "$pkg" "$suite")
  [ -n "$version" ] || die "$pkg is not in $suite at $mirror"
  if [ "$(cat "$dest/.gpucr-version" 2>/dev/null)" = "$version" ]; then
    say "$pkg $version ($suite) already in $dest"
    return 0
  fi
  (cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" -qq download "$pkg=$version")
  deb=$(ls "$apt_dir/debs/${pkg}_${version#*:}_"*.deb)
  rm -rf "$dest.new"
  dpkg -x "$deb" "$dest.new"
  echo "$version" > "$dest.new/.gpucr-version"
  rm -rf "$dest"
  mv "$dest.new" "$dest"
  say "$pkg $version ($suite) unpacked into $dest"
}

fetch_unpack containerd sid "$prefix/containerd2"
fetch_unpack checkpointctl trixie "$prefix/checkpointctl"
fetch_unpack libc6 trixie "$prefix/libc6"

mkdir -p "$prefix/bin"
libdir=$prefix/libc6/usr/lib/x86_64-linux-gnu
cat > "$prefix/bin/checkpointctl.new" <<EOF
#!/bin/sh
# trixie's checkpointctl with trixie's glibc (tests/containerd2.sh); the node's libc is older.
exec $libdir/ld-linux-x86-64.so.2 --library-path $libdir --argv0 checkpointctl \\
  $prefix/checkpointctl/usr/bin/checkpointctl "\$@"
EOF
chmod 755 "$prefix/bin/checkpointctl.new"
mv "$prefix/bin/checkpointctl.new" "$prefix/bin/checkpointctl"

containerd=$prefix/containerd2/usr/bin/containerd
got=$("$containerd" --version) || die "$containerd does not run"
case "$got" in
  *" 2."*) say "ok: $got" ;;
  *) die "$containerd is not 2.x: $got" ;;
esac
"$prefix/containerd2/usr/bin/ctr" --version >/dev/null || die "ctr 2.x does not run"
"$prefix/bin/checkpointctl" --help >/dev/null || die "checkpointctl does not run"
say "ok: checkpointctl $(cat "$prefix/checkpointctl/.gpucr-version") runs (with trixie's libc)"
echo "GPUCR_TEST_CONTAINERD2=$containerd"
echo "GPUCR_CHECKPOINTCTL=$prefix/bin/checkpointctl"
