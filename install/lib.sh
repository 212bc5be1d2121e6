# Shared helpers for install/*.sh and tests/run.sh (sourced, not run).
# shellcheck shell=bash

gpucr_state_dir=/var/lib/gpucr

gpucr_die() { echo "${gpucr_tag:-gpucr}: ERROR: $*" >&2; exit 1; }
gpucr_say() { echo "${gpucr_tag:-gpucr}: $*"; }

# Re-runs the calling script as root: through sudo where it exists, otherwise it explains.
# usage: gpucr_as_root "$script" "$@"   (call before anything else happens)
# The caller's cargo (rustup installs it in ~/.cargo/bin, which sudo's secure_path hides) is
# handed on as GPUCR_CARGO.
gpucr_as_root() {
  local script=$1; shift
  [ "$(id -u)" = 0 ] && return 0
  if command -v sudo >/dev/null 2>&1; then
    local cargo_bin
    cargo_bin=$(command -v cargo 2>/dev/null || true)
    echo "${gpucr_tag:-gpucr}: not root; re-running with sudo" >&2
    exec sudo env GPUCR_CARGO="${GPUCR_CARGO:-$cargo_bin}" \
      ${GPUCR_TEST_RUNTIME:+GPUCR_TEST_RUNTIME="$GPUCR_TEST_RUNTIME"} \
      ${TEST_THREADS:+TEST_THREADS="$TEST_THREADS"} \
      bash "$script" "$@"
  fi
  gpucr_die "must run as root (containerd, CRIU and mounts need it) and sudo is not installed: run it as root, e.g. su -c 'bash $script'"
}

# Home directory of the user who ran sudo (empty when not under sudo).
gpucr_sudo_home() {
  [ -n "${SUDO_USER:-}" ] && [ "${SUDO_USER}" != root ] || return 0
  getent passwd "$SUDO_USER" | cut -d: -f6
}

# Puts cargo on PATH: PATH itself, GPUCR_CARGO (handed on by gpucr_as_root), the sudo user's
# ~/.cargo/bin, then root's. A rustup cargo of another user also needs that user's RUSTUP_HOME
# and CARGO_HOME. Returns 1 when there is no cargo at all.
gpucr_find_cargo() {
  command -v cargo >/dev/null 2>&1 && return 0
  local home cand
  home=$(gpucr_sudo_home)
  for cand in "${GPUCR_CARGO:-}" "${home:+$home/.cargo/bin/cargo}" "${CARGO_HOME:-$HOME/.cargo}/bin/cargo"; do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    PATH="$(dirname "$cand"):$PATH"
    export PATH
    # rustup's proxies look for toolchains under $RUSTUP_HOME (default ~/.rustup of *this* HOME).
    local owner_home
    owner_home=$(dirname "$(dirname "$(dirname "$cand")")")
    if [ -z "${RUSTUP_HOME:-}" ] && [ -d "$owner_home/.rustup" ]; then
      export RUSTUP_HOME="$owner_home/.rustup"
    fi
    if [ -z "${CARGO_HOME:-}" ] && [ "$(dirname "$(dirname "$cand")")" = "$owner_home/.cargo" ]; then
      export CARGO_HOME="$owner_home/.cargo"
    fi
    return 0
  done
  return 1
}

# apt-get install that refuses to change any package that is already installed.
# It simulates first: an "Inst pkg [old-version] ..." line is an upgrade/downgrade of an
# installed package and "Remv" a removal; either one stops the install with the list.
# Packages it installs are appended to $gpucr_state_dir/deps-packages (name version origin).
# usage: gpucr_apt_install_new PKG[/RELEASE|=VERSION]...
gpucr_apt_install_new() {
  local sim changes new
  if ! sim=$(apt-get install -s --no-install-recommends --no-upgrade "$@" 2>&1); then
    echo "$sim" >&2
    gpucr_die "apt cannot install $*; see above"
  fi
  changes=$(printf '%s\n' "$sim" | grep -E '^(Inst [^ ]+ \[|Remv )' || true)
  if [ -n "$changes" ]; then
    echo "$changes" >&2
    gpucr_die "installing $* would change packages already installed (above); nothing was installed. Install these by hand if you accept that, then re-run."
  fi
  new=$(printf '%s\n' "$sim" | sed -n 's/^Inst \([^ ]*\) (\([^ ]*\) \([^)]*\)).*/\1 \2 \3/p')
  if [ -z "$new" ]; then
    gpucr_say "already installed: $*"
    return 0
  fi
  gpucr_say "apt installs (package version release):"
  printf '%s\n' "$new" | sed 's/^/    /'
  apt-get install -y -qq --no-install-recommends --no-upgrade "$@" >/dev/null
  mkdir -p "$gpucr_state_dir"
  printf '%s\n' "$new" >> "$gpucr_state_dir/deps-packages"
}

# True when installing the packages would upgrade, downgrade or remove an installed package.
gpucr_apt_would_change() {
  local sim
  sim=$(apt-get install -s --no-install-recommends --no-upgrade "$@" 2>&1) || return 0
  printf '%s\n' "$sim" | grep -qE '^(Inst [^ ]+ \[|Remv )'
}

# The candidate (or installed) version of a package, empty when apt knows none.
gpucr_apt_candidate() {
  apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2}' | grep -v '^(none)$' || true
}
gpucr_dpkg_version() {
  { dpkg-query -W -f '${db:Status-Abbrev} ${Version}\n' "$1" 2>/dev/null || true; } | awk '$1 ~ /^ii/ {print $2}'
}

# containerd 1.x: the runtime class is a block at the end of config.toml between these lines.
gpucr_block_begin="# BEGIN gpucr: added by install/install.sh (install/uninstall.sh removes this block)"
gpucr_block_end="# END gpucr"
# Prints config.toml without that block and the one blank line before it.
gpucr_strip_block() {
  awk -v b="$gpucr_block_begin" -v e="$gpucr_block_end" '
    skip { if ($0 == e) skip = 0; next }
    $0 == b { skip = 1; held = 0; next }
    held { print ""; held = 0 }
    $0 == "" { held = 1; next }
    { print }
    END { if (held) print "" }' "$1"
}
