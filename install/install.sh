#!/usr/bin/env bash
# Installs gpucr on Debian/Ubuntu: runtime dependencies (install/deps.sh: containerd, runc,
# iptables, CRIU >= 4 — changing no installed package), release binaries, gpucr's CRIU plugin,
# the hook library, and the `gpucr` runtime class for containerd 1.7 / 2.x.
#
#   $prefix/bin/containerd-shim-gpucr-v2     the runtime io.containerd.gpucr.v2 (prefix /usr/local)
#   $prefix/bin/gpucr-copyin                 restore copy-in helper (the shim starts it)
#   $prefix/bin/gpucr                        the operator CLI of gpucr's checkpoint store
#   /usr/lib/criu/gpucr_cuda_plugin.so       CRIU plugin (CRIU loads every *.so there)
#   /usr/lib/gpucr/libgpucr_hook.so          hook library, preloaded into GPU containers
#   /etc/containerd/conf.d/gpucr.toml        runtime class `gpucr`, imported from config.toml
#   /var/lib/gpucr/install-manifest          what this script installed (install/uninstall.sh)
#
# Running it again changes nothing that is already in place. containerd is not restarted.
#
# usage: install/install.sh [--no-deps] [--no-build] [--from DIR] [--prefix DIR]
#   --no-deps    skip install/deps.sh
#   --no-build   do not run cargo; install what is already built (in target/release or --from)
#   --from DIR   take the built files from DIR instead of target/release (implies --no-build)
#   --prefix DIR where bin/ goes (default /usr/local)
# env: GPUCR_DESTDIR  install under this directory instead of / (tests; the paths written into
#                     config.toml then include it)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(dirname "$here")
gpucr_tag=gpucr-install
# shellcheck source=install/lib.sh
. "$here/lib.sh"
gpucr_as_root "$here/install.sh" "$@"

root=${GPUCR_DESTDIR:-}
prefix=/usr/local
deps=1
build=1
from="$top/target/release"
while [ $# -gt 0 ]; do
  case "$1" in
    --no-deps) deps=0 ;;
    --no-build) build=0 ;;
    --from) from=$(cd "$2" && pwd); build=0; shift ;;
    --prefix) prefix=$2; shift ;;
    *) echo "usage: install/install.sh [--no-deps] [--no-build] [--from DIR] [--prefix DIR] (unknown argument $1)" >&2; exit 2 ;;
  esac
  shift
done
say() { gpucr_say "$@"; }
die() { gpucr_die "$@"; }

gpucr_state_dir="$root$gpucr_state_dir"
bin_dir="$root$prefix/bin"
criu_plugin_dir="$root/usr/lib/criu"
hook_dir="$root/usr/lib/gpucr"
cfg_dir="$root/etc/containerd"
cfg="$cfg_dir/config.toml"
dropin_dir="$cfg_dir/conf.d"
dropin="$dropin_dir/gpucr.toml"
import_glob="$dropin_dir/*.toml"
manifest="$gpucr_state_dir/install-manifest"
marker="# added by gpucr's install/install.sh (install/uninstall.sh removes it):"

[ "$deps" = 1 ] && bash "$here/deps.sh"

# --- which drop-in: it must match the version of the config.toml that imports it ---------------
command -v containerd >/dev/null || die "containerd not found: run install/deps.sh (or install containerd >= 1.7), then re-run"
ctr_version=$(containerd --version | awk '{print $3}' | sed 's/^v//')
ctr_major=${ctr_version%%.*}
# Top-level keys are the lines before the first [table].
toplevel() { awk '/^[[:space:]]*\[/ {exit} {print}' "$1"; }
if [ -f "$cfg" ]; then
  cfg_version=$(toplevel "$cfg" | sed -n 's/^[[:space:]]*version[[:space:]]*=[[:space:]]*\([0-9]*\).*/\1/p' | head -1)
  case "$cfg_version" in
    2) ;;  # containerd 2.x reads (and migrates) version 2 too, e.g. Debian's shipped config.toml
    3) [ "$ctr_major" -ge 2 ] || die "$cfg is config version 3, which containerd $ctr_version cannot read; fix the config first" ;;
    "") die "$cfg has no top-level 'version' (a version-1 config); a version 2/3 drop-in would change how containerd reads it. Convert it first (containerd 2.x: 'containerd config migrate'; 1.7: add 'version = 2' and the full plugin names, see 'containerd config default'), then re-run" ;;
    *) die "$cfg: config version '$cfg_version' is not supported (2 or 3 are)" ;;
  esac
else
  if [ "$ctr_major" -ge 2 ]; then cfg_version=3; else cfg_version=2; fi
fi

# --- the manifest: "KIND PATH [DATA]" lines; a re-run keeps the records of earlier runs --------
declare -A rec=()
order=()
if [ -f "$manifest" ]; then
  while read -r kind path data; do
    [ -n "${kind:-}" ] && [ "${kind:0:1}" != "#" ] || continue
    rec["$kind $path"]=$data
    order+=("$kind $path")
  done < "$manifest"
fi
record() {  # record KIND PATH [DATA]
  local key="$1 $2"
  [ -n "${rec[$key]+x}" ] || order+=("$key")
  rec["$key"]=${3:-}
}
save_manifest() {
  mkdir -p "$gpucr_state_dir"
  {
    echo "# gpucr install/install.sh: what it installed (install/uninstall.sh removes exactly this)"
    local k
    for k in "${order[@]}"; do [ -n "${rec[$k]+x}" ] && echo "$k${rec[$k]:+ ${rec[$k]}}"; done
  } > "$manifest.new"
  if cmp -s "$manifest.new" "$manifest"; then rm -f "$manifest.new"; else mv -f "$manifest.new" "$manifest"; fi
}

make_dir() {  # creates DIR and records each directory it had to create
  local d=$1
  [ -d "$d" ] && return 0
  make_dir "$(dirname "$d")"
  mkdir -m 0755 "$d"
  record dir "$d"
}
put_file() {  # put_file SRC DEST MODE: copies only when content or mode differ (no new mtime)
  local src=$1 dest=$2 mode=$3
  [ -f "$src" ] || die "missing $src: build first (cargo build --release), or pass --from DIR"
  make_dir "$(dirname "$dest")"
  if [ -f "$dest" ] && cmp -s "$src" "$dest" && [ "$(stat -c %a "$dest")" = "${mode#0}" ]; then
    say "unchanged $dest"
  else
    # Renamed into place: a running shim keeps its old binary (no "text file busy").
    install -m "$mode" "$src" "$dest.gpucr-new"
    mv -f "$dest.gpucr-new" "$dest"
    say "installed $dest"
  fi
  record file "$dest" "$(sha256sum "$dest" | cut -d' ' -f1)"
}

# --- build -----------------------------------------------------------------------------------
if [ "$build" = 1 ]; then
  gpucr_find_cargo || die "cargo not found (not on PATH, not in ~/.cargo/bin of root or \$SUDO_USER): install a Rust toolchain (https://rustup.rs) and re-run, or build elsewhere and pass --from DIR"
  # -p gpucr-hook builds gpucr-copyin (with the cuda feature the preload library turns on).
  cargo_args=(build --release --locked -p containerd-shim-gpucr-v2 -p gpucr-criu-plugin -p gpucr-hook-preload -p gpucr-hook -p gpucr-store)
  owner=$(stat -c %U "$top")
  if [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ] && [ "$owner" = "$SUDO_USER" ]; then
    # Build as the checkout's owner: target/ and ~/.cargo stay theirs.
    say "building release binaries (as $SUDO_USER)"
    (cd "$top" && runuser -u "$SUDO_USER" -- env PATH="$PATH" HOME="$(gpucr_sudo_home)" cargo "${cargo_args[@]}")
  else
    say "building release binaries"
    (cd "$top" && cargo "${cargo_args[@]}")
  fi
fi

# --- files -----------------------------------------------------------------------------------
put_file "$from/containerd-shim-gpucr-v2" "$bin_dir/containerd-shim-gpucr-v2" 0755
# The restore's copy-in helper: the shim starts it from its own directory.
put_file "$from/gpucr-copyin" "$bin_dir/gpucr-copyin" 0755
# The operator CLI (gpucr ls/validate/gc/push/pull); a --from directory built before it existed
# (an older GPU carry) may lack it: the runtime does not need it.
if [ -f "$from/gpucr" ]; then
  put_file "$from/gpucr" "$bin_dir/gpucr" 0755
else
  say "no gpucr CLI in $from: not installed (the runtime does not need it)"
fi
# CRIU loads every *.so in its plugin directory (/usr/lib/criu; deps.sh builds CRIU that way).
put_file "$from/libgpucr_criu_plugin.so" "$criu_plugin_dir/gpucr_cuda_plugin.so" 0644
# Preloaded by the shim into GPU containers (read-only bind mount); io.gpucr.hook=off per
# container turns it off, GPUCR_HOOK_LIB in containerd's environment points elsewhere.
put_file "$from/libgpucr_hook.so" "$hook_dir/libgpucr_hook.so" 0644
if [ "$ctr_major" -ge 2 ]; then
  put_file "$here/containerd/gpucr-v$cfg_version.toml" "$dropin" 0644
fi

# --- the runtime class in containerd's config -------------------------------------------------
# containerd 2.x merges an imported file into config.toml table by table: the drop-in in conf.d,
# imported from config.toml. containerd 1.x replaces a whole plugin section with the imported
# one, so a drop-in would throw away config.toml's CRI settings (sandbox image, runtimes, CNI...)
# and leave CRI without its runc runtime: there the runtime tables go into config.toml itself,
# as one marked block at its end.
make_dir "$cfg_dir"
if [ "$ctr_major" -lt 2 ]; then
  if [ -f "$dropin" ]; then
    if [ -n "${rec["file $dropin"]+x}" ]; then
      # An earlier install (containerd 2.x then) put it there; on 1.x it would clobber CRI's config.
      rm -f "$dropin"; unset "rec[file $dropin]"; say "removed $dropin (containerd 1.x: the runtime class goes into $cfg)"
    elif grep -qs 'conf.d' "$cfg"; then
      say "WARNING: $cfg imports $dropin (from an earlier gpucr install?): containerd 1.x then replaces config.toml's whole CRI section with it. Remove that file and the imports line."
    fi
  fi
  # The block: install/containerd/gpucr-v2.toml's tables, and runc's if config.toml has none of its
  # own (a runtimes table replaces containerd's default list, runc included).
  block=$(sed -n '/^\[/,$p' "$here/containerd/gpucr-v2.toml")
  outside=""
  [ ! -f "$cfg" ] || outside=$(gpucr_strip_block "$cfg")
  if ! grep -qE '^[[:space:]]*\[plugins\."io\.containerd\.grpc\.v1\.cri"\.containerd\.runtimes\.runc\]' <<<"$outside"; then
    block=$(printf '%s\n\n%s\n%s' "$block" "# containerd's default runtime, which the gpucr table above would otherwise replace" \
      '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"')
  fi
  block=$(printf '%s\n%s\n%s' "$gpucr_block_begin" "$block" "$gpucr_block_end")
  if [ ! -f "$cfg" ]; then
    printf 'version = 2\n\n%s\n' "$block" > "$cfg"
    record config-created "$cfg" "$(sha256sum "$cfg" | cut -d' ' -f1)"
    say "created $cfg (version 2, runtime class gpucr)"
  elif grep -qE '^[[:space:]]*\[plugins\."io\.containerd\.grpc\.v1\.cri"\.containerd\.runtimes\.gpucr\]' <<<"$outside"; then
    say "NOTE: $cfg defines runtime gpucr itself; left as it is"
  else
    current=$(awk -v b="$gpucr_block_begin" -v e="$gpucr_block_end" '$0 == b {on = 1} on {print} $0 == e {on = 0}' "$cfg")
    if [ "$current" = "$block" ]; then
      say "unchanged $cfg (runtime class gpucr)"
    else
      # Replace an old block (or add one): the file's last lines, after one blank line.
      { gpucr_strip_block "$cfg"; echo; printf '%s\n' "$block"; } > "$cfg.gpucr-new"
      cat "$cfg.gpucr-new" > "$cfg" && rm -f "$cfg.gpucr-new"   # keeps the file's owner and mode
      record config-block "$cfg"
      say "added to $cfg, between '$gpucr_block_begin' and '$gpucr_block_end': runtime gpucr$(grep -q 'runtimes.runc]' <<<"$block" && echo ' and runc (CRI default; config.toml had no runc table)')"
    fi
  fi
else
  if [ -f "$cfg" ] && grep -qxF "$gpucr_block_begin" "$cfg"; then
    # An earlier install (containerd 1.x then) put the runtime class into config.toml.
    gpucr_strip_block "$cfg" > "$cfg.gpucr-new"; cat "$cfg.gpucr-new" > "$cfg"; rm -f "$cfg.gpucr-new"
    unset "rec[config-block $cfg]"; say "removed the gpucr block from $cfg (containerd 2.x: the drop-in is used)"
  fi
  imports_new="imports = [\"$import_glob\"]"
  if [ ! -f "$cfg" ]; then
    printf 'version = %s\n%s\n%s\n' "$cfg_version" "$marker" "$imports_new" > "$cfg"
    record config-created "$cfg" "$(sha256sum "$cfg" | cut -d' ' -f1)"
    say "created $cfg (version $cfg_version, imports $import_glob)"
  else
    imports=$(toplevel "$cfg" | grep -E '^[[:space:]]*imports[[:space:]]*=' || true)
    if [ -z "$imports" ]; then
      # Top-level keys must precede the first table: put the import first.
      { echo "$marker"; echo "$imports_new"; cat "$cfg"; } > "$cfg.gpucr-new"
      cat "$cfg.gpucr-new" > "$cfg" && rm -f "$cfg.gpucr-new"   # keeps the file's owner and mode
      record imports-added "$cfg"
      say "added to $cfg: $imports_new"
    elif [[ $imports == *"\"$import_glob\""* ]]; then
      say "unchanged $cfg (imports $import_glob already)"
    elif [ "$(printf '%s\n' "$imports" | wc -l)" = 1 ] && [[ $imports =~ ^[[:space:]]*imports[[:space:]]*=[[:space:]]*\[.*\][[:space:]]*$ ]]; then
      # A one-line array: append our glob; uninstall puts the old line back.
      if [[ $imports =~ \[[[:space:]]*\] ]]; then
        replaced="$imports_new"
      else
        replaced="${imports%]*}, \"$import_glob\"]"
      fi
      mkdir -p "$gpucr_state_dir"
      printf '%s\n' "$imports" > "$gpucr_state_dir/imports-line.orig"
      printf '%s\n' "$replaced" > "$gpucr_state_dir/imports-line.new"
      awk -v old="$imports" -v new="$replaced" -v marker="$marker" \
        '!done && $0 == old {print marker; print new; done = 1; next} {print}' "$cfg" > "$cfg.gpucr-new"
      cat "$cfg.gpucr-new" > "$cfg" && rm -f "$cfg.gpucr-new"
      record imports-replaced "$cfg"
      say "changed in $cfg: '$imports' -> '$replaced'"
    else
      say "NOTE: $cfg has a multi-line imports array; add \"$import_glob\" to it yourself"
    fi
  fi
fi
save_manifest

# The merged config must still load and show the runtime class.
if dump=$(containerd --config "$cfg" config dump 2>&1); then
  grep -qE "runtime_type = [\"']io.containerd.gpucr.v2" <<<"$dump" \
    || say "WARNING: 'containerd --config $cfg config dump' does not show the gpucr runtime class (is $import_glob imported?)"
  # CRI refuses to start when its default runtime is not among the runtimes.
  default_rt=$(sed -n "s/^ *default_runtime_name = [\"']\([^\"']*\)[\"'].*/\1/p" <<<"$dump" | head -1)
  if [ -n "$default_rt" ] && ! grep -qE "\.runtimes\.[\"']?${default_rt}[\"']?\]" <<<"$dump"; then
    die "after the merge, CRI's default runtime '$default_rt' is not among its runtimes in $cfg ('containerd config dump'); install/uninstall.sh undoes this install"
  fi
else
  echo "$dump" >&2
  die "containerd cannot load $cfg after the merge (above); install/uninstall.sh undoes this install"
fi
if [ "$ctr_major" -ge 2 ]; then where=$dropin; else where="the gpucr block of $cfg"; fi
say "runtime class gpucr registered for containerd $ctr_version (config version $cfg_version, in $where)"
say "manifest: $manifest"
say "Kubernetes: kubectl apply -f $here/kubernetes/runtimeclass.yaml"
if command -v pgrep >/dev/null && pgrep -x containerd >/dev/null; then
  say "restart containerd to load the CRI runtime class (ctr --runtime io.containerd.gpucr.v2 works now)"
fi
