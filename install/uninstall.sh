#!/usr/bin/env bash
# Removes what install/install.sh installed, as listed in /var/lib/gpucr/install-manifest:
# the binaries, the CRIU plugin, the hook library, the containerd drop-in, the imports line of
# config.toml if install.sh added or changed it (a config.toml it created is removed if unchanged),
# and the directories it created if they are empty. Nothing else: containerd, runc, CRIU and the
# packages install/deps.sh installed stay (it prints how to remove those).
#
# usage: install/uninstall.sh [--remove-criu]
#   --remove-criu  also remove /usr/local/sbin/criu if install/deps.sh built it
# env: GPUCR_DESTDIR  as for install.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
gpucr_tag=gpucr-uninstall
# shellcheck source=install/lib.sh
. "$here/lib.sh"
gpucr_as_root "$here/uninstall.sh" "$@"

remove_criu=0
while [ $# -gt 0 ]; do
  case "$1" in
    --remove-criu) remove_criu=1 ;;
    *) echo "usage: install/uninstall.sh [--remove-criu] (unknown argument $1)" >&2; exit 2 ;;
  esac
  shift
done
say() { gpucr_say "$@"; }
root=${GPUCR_DESTDIR:-}
state="$root$gpucr_state_dir"
manifest="$state/install-manifest"
marker="# added by gpucr's install/install.sh (install/uninstall.sh removes it):"

# Drops "$marker" and the line after it when that line is $1.
drop_marked() {  # drop_marked CFG LINE [REPLACEMENT]
  local cfg=$1 line=$2 repl=${3-}
  awk -v marker="$marker" -v line="$line" -v repl="$repl" -v has_repl="${3+x}" '
    held { held = 0; if ($0 == line) { if (has_repl == "x") print repl; next } print marker }
    $0 == marker { held = 1; next }
    { print }
    END { if (held) print marker }' "$cfg" > "$cfg.gpucr-new"
  if cmp -s "$cfg.gpucr-new" "$cfg"; then
    rm -f "$cfg.gpucr-new"; return 1
  fi
  cat "$cfg.gpucr-new" > "$cfg" && rm -f "$cfg.gpucr-new"   # keeps the file's owner and mode
}

if [ -f "$manifest" ]; then
  if pgrep -x containerd-shim-gpucr-v2 >/dev/null 2>&1; then
    say "NOTE: gpucr shims are running; their containers keep running, but restart containerd before using it again"
  fi
  dirs=()
  while read -r kind path data; do
    [ -n "${kind:-}" ] && [ "${kind:0:1}" != "#" ] || continue
    case "$kind" in
      file)
        if [ -e "$path" ]; then
          [ "$(sha256sum "$path" | cut -d' ' -f1)" = "$data" ] || say "NOTE: $path changed since it was installed; removing it anyway"
          rm -f "$path"; say "removed $path"
        fi ;;
      dir) dirs=("$path" "${dirs[@]}") ;;   # deepest first
      imports-added)
        glob="$(dirname "$path")/conf.d/*.toml"
        [ -f "$path" ] && drop_marked "$path" "imports = [\"$glob\"]" \
          && say "removed the imports line from $path" \
          || say "NOTE: $path: the imports line install.sh added is gone or changed; left as it is" ;;
      imports-replaced)
        if [ -f "$path" ] && [ -f "$state/imports-line.orig" ] \
          && drop_marked "$path" "$(cat "$state/imports-line.new")" "$(cat "$state/imports-line.orig")"; then
          say "restored the imports line of $path: $(cat "$state/imports-line.orig")"
        else
          say "NOTE: $path: the imports line install.sh changed is gone or changed; left as it is"
        fi
        rm -f "$state/imports-line.orig" "$state/imports-line.new" ;;
      config-block)
        if [ -f "$path" ] && grep -qxF "$gpucr_block_begin" "$path"; then
          gpucr_strip_block "$path" > "$path.gpucr-new"
          cat "$path.gpucr-new" > "$path" && rm -f "$path.gpucr-new"
          say "removed the gpucr block (runtime class) from $path"
        fi ;;
      config-created)
        if [ -f "$path" ] && [ "$(sha256sum "$path" | cut -d' ' -f1)" = "$data" ]; then
          rm -f "$path"; say "removed $path (install.sh created it; unchanged since)"
        elif [ -f "$path" ]; then
          glob="$(dirname "$path")/conf.d/*.toml"
          drop_marked "$path" "imports = [\"$glob\"]" || true
          say "NOTE: kept $path (install.sh created it, but it was changed since); removed only its imports line"
        fi ;;
      *) say "NOTE: unknown manifest record '$kind $path'; ignored" ;;
    esac
  done < "$manifest"
  rm -f "$manifest"
  for d in "${dirs[@]}"; do
    [ -d "$d" ] && rmdir "$d" 2>/dev/null && say "removed directory $d" || true
  done
else
  say "no $manifest: install.sh has not installed anything here (or it was removed already)"
fi

criu_rec=$(grep -s '^/usr/local/sbin/criu built-from' "$state/deps-files" || true)
if [ -n "$criu_rec" ]; then
  if [ "$remove_criu" = 1 ]; then
    rm -f "$root/usr/local/sbin/criu"
    sed -i '\#^/usr/local/sbin/criu built-from#d' "$state/deps-files"
    [ -s "$state/deps-files" ] || rm -f "$state/deps-files"
    say "removed /usr/local/sbin/criu (install/deps.sh built it)"
  else
    say "kept /usr/local/sbin/criu (install/deps.sh built it; --remove-criu removes it)"
  fi
fi
if [ -s "$state/deps-packages" ]; then
  say "kept the packages install/deps.sh installed ($state/deps-packages); to remove them too:"
  echo "    apt-get purge $(awk '{print $1}' "$state/deps-packages" | sort -u | tr '\n' ' ')"
fi
[ -d "$state" ] && rmdir "$state" 2>/dev/null || true
say "done; restart containerd to drop the gpucr runtime class from CRI"
