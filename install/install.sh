#!/usr/bin/env bash
# Installs gpucr on Debian/Ubuntu: runtime dependencies (containerd, runc, iptables, CRIU >= 4),
# release binaries, gpucr's CRIU plugin, and the `gpucr` runtime class for containerd 1.7 / 2.x.
#
# usage: install/install.sh [--no-deps] [--prefix DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(dirname "$here")
prefix=/usr/local
deps=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-deps) deps=0 ;;
    --prefix) prefix=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
say() { echo "gpucr-install: $*"; }

[ "$(id -u)" = 0 ] || { echo "run as root (containerd, CRIU and mounts need it)" >&2; exit 1; }
[ "$deps" = 1 ] && bash "$here/deps.sh"

command -v cargo >/dev/null || {
  echo "cargo not found: install a Rust toolchain (https://rustup.rs) and re-run" >&2; exit 1; }
say "building release binaries"
# -p gpucr-hook builds gpucr-copyin (with the cuda feature the preload library turns on).
(cd "$top" && cargo build --release --locked -p containerd-shim-gpucr-v2 -p gpucr-criu-plugin -p gpucr-hook-preload -p gpucr-hook)

install -D -m 0755 "$top/target/release/containerd-shim-gpucr-v2" "$prefix/bin/containerd-shim-gpucr-v2"
say "installed $prefix/bin/containerd-shim-gpucr-v2 (runtime io.containerd.gpucr.v2)"
# The restore's copy-in helper: the shim starts it from its own directory.
install -D -m 0755 "$top/target/release/gpucr-copyin" "$prefix/bin/gpucr-copyin"
say "installed $prefix/bin/gpucr-copyin (restores copy device memory in with it; io.gpucr.restore-helpers=0 per container turns it off)"

# CRIU loads every *.so in its plugin directory (/usr/lib/criu unless --libdir is given).
plugin_dir=/usr/lib/criu
install -D -m 0644 "$top/target/release/libgpucr_criu_plugin.so" "$plugin_dir/gpucr_cuda_plugin.so"
say "installed CRIU plugin $plugin_dir/gpucr_cuda_plugin.so (CUDA processes, no cuda-checkpoint binary)"

# The hook library (package gpucr-hook-preload), preloaded by the shim into GPU containers
# (read-only bind mount).
install -D -m 0644 "$top/target/release/libgpucr_hook.so" /usr/lib/gpucr/libgpucr_hook.so
say "installed /usr/lib/gpucr/libgpucr_hook.so (GPU containers get it; io.gpucr.hook=off per container, GPUCR_HOOK_LIB for another path)"

# Register the runtime class with containerd through a conf.d drop-in.
ctr_version=$(containerd --version 2>/dev/null | awk '{print $3}' | sed 's/^v//')
major=${ctr_version%%.*}
mkdir -p /etc/containerd/conf.d
if [ "${major:-1}" -ge 2 ] 2>/dev/null; then
  install -m 0644 "$here/containerd/gpucr-v3.toml" /etc/containerd/conf.d/gpucr.toml
  cfg_version=3
else
  install -m 0644 "$here/containerd/gpucr-v2.toml" /etc/containerd/conf.d/gpucr.toml
  cfg_version=2
fi
cfg=/etc/containerd/config.toml
if [ ! -f "$cfg" ]; then
  printf 'version = %s\nimports = ["/etc/containerd/conf.d/*.toml"]\n' "$cfg_version" > "$cfg"
elif ! grep -q '^imports' "$cfg"; then
  # Top-level keys must precede the first table: put the import first.
  { echo 'imports = ["/etc/containerd/conf.d/*.toml"]'; cat "$cfg"; } > "$cfg.gpucr-new"
  mv "$cfg.gpucr-new" "$cfg"
elif ! grep -q 'conf.d' "$cfg"; then
  say "NOTE: $cfg already has an imports line; add \"/etc/containerd/conf.d/*.toml\" to it"
fi
say "registered runtime class gpucr for containerd ${ctr_version:-?} (config version $cfg_version)"
say "Kubernetes: kubectl apply -f $here/kubernetes/runtimeclass.yaml"
if pgrep -x containerd >/dev/null; then
  say "restart containerd to load the CRI runtime class (ctr --runtime io.containerd.gpucr.v2 works now)"
fi
