#!/usr/bin/env bash
# The install leaves the node alone (issue #20). tests/run.sh runs it as root:
#
#   tests/node-unchanged.sh snapshot-packages DIR   before install/deps.sh: dpkg's package list
#   tests/node-unchanged.sh snapshot-config DIR     before install/install.sh: /etc/containerd
#   tests/node-unchanged.sh check DIR [--from BUILT] after the first install, and then:
#     1. no package installed before changed version or was removed (new ones are fine)
#     2. a second deps.sh + install.sh changes nothing: packages, installed files (content and
#        mtime), /etc/containerd, /etc/apt, the manifest
#     3. uninstall.sh removes every file of the manifest and puts /etc/containerd back as it
#        was before the install; installing again gives the same files and config as the first
#     4. the config merge (in a scratch GPUCR_DESTDIR, with a fake `containerd --version` 2.x):
#        2.x: v2 config.toml -> v2 drop-in, imported; no config -> v3 config + v3 drop-in;
#        `imports = []` is extended and restored by uninstall. 1.x (which replaces whole plugin
#        sections with imported ones): the runtime class goes into config.toml, every CRI setting
#        there stays (containerd config dump), uninstall restores the file byte for byte; no
#        config -> a v2 one. A v3 config on 1.x and a version-less (v1) config are refused with
#        nothing installed.
# It ends with gpucr installed, as after the first install.
set -euo pipefail
export LC_ALL=C   # sort and join must agree
cd "$(dirname "$0")/.."
repo=$(pwd)
fail=0
bad() { echo "node-unchanged: FAIL: $*"; fail=1; }
ok() { echo "node-unchanged: ok: $*"; }
pkgs() { dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${Version}\n' | awk '$1 ~ /^ii/ {print $2, $3}' | sort; }
manifest=/var/lib/gpucr/install-manifest

cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: $0 snapshot-packages|snapshot-config|check DIR [--from BUILT]" >&2; exit 2; }
mkdir -p "$dir"
case "$cmd" in
  snapshot-packages) pkgs > "$dir/packages-before"; exit 0 ;;
  snapshot-config)
    rm -rf "$dir/etc-containerd-before"
    if [ -d /etc/containerd ]; then cp -a /etc/containerd "$dir/etc-containerd-before"; fi
    exit 0 ;;
  check) ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
from="$repo/target/release"
[ "${3:-}" = --from ] && from=$4

# Files, contents and mtimes of what the install touches (the manifest's files, config, apt).
state() {
  {
    pkgs | sed 's/^/pkg /'
    [ -f "$manifest" ] && awk '$1 == "file" {print $2}' "$manifest" | while read -r f; do
      if [ -e "$f" ]; then echo "file $f $(stat -c '%a %Y' "$f") $(sha256sum < "$f" | cut -c1-64)"; else echo "file $f MISSING"; fi
    done
    { find /etc/containerd /etc/apt /var/lib/gpucr /usr/local/sbin/criu -type f 2>/dev/null || true; } | sort \
      | while read -r f; do echo "tree $f $(stat -c '%a %Y' "$f") $(sha256sum < "$f" | cut -c1-64)"; done
  }
}
without_mtimes() { sed -E 's/^((file|tree) [^ ]+ [0-7]+) [0-9]+ /\1 /'; }

# 1. packages
if [ -f "$dir/packages-before" ]; then
  pkgs > "$dir/packages-after"
  changed=$(join "$dir/packages-before" "$dir/packages-after" | awk '$2 != $3 {print "  changed: " $1 " " $2 " -> " $3}')
  removed=$(join -v1 "$dir/packages-before" "$dir/packages-after" | sed 's/^/  removed: /')
  added=$(join -v2 "$dir/packages-before" "$dir/packages-after" | awk '{print $1}' | tr '\n' ' ')
  if [ -n "$changed$removed" ]; then
    bad "the install changed packages that were installed before it:"; printf '%s\n' "$changed" "$removed" | sed '/^$/d'
  else
    ok "no installed package changed or was removed ($(wc -l < "$dir/packages-before") before; new: ${added:-none})"
  fi
else
  bad "no $dir/packages-before (run '$0 snapshot-packages $dir' before install/deps.sh)"
fi

# 2. a second install changes nothing
[ -f "$manifest" ] || { bad "no $manifest after the install"; exit 1; }
state > "$dir/state-1"
bash install/deps.sh > "$dir/deps-2.log" 2>&1 || { cat "$dir/deps-2.log"; bad "second install/deps.sh failed"; }
bash install/install.sh --no-deps --from "$from" > "$dir/install-2.log" 2>&1 || { cat "$dir/install-2.log"; bad "second install/install.sh failed"; }
state > "$dir/state-2"
if diff "$dir/state-1" "$dir/state-2" > "$dir/state-1-2.diff"; then
  ok "a second deps.sh + install.sh changed nothing ($(grep -c '^file ' "$dir/state-1") installed files, /etc/containerd, /etc/apt, CRIU, packages)"
else
  bad "the second install changed:"; cat "$dir/state-1-2.diff"
fi

# 3. uninstall, then install again
files=$(awk '$1 == "file" {print $2}' "$manifest")
bash install/uninstall.sh > "$dir/uninstall.log" 2>&1 || { cat "$dir/uninstall.log"; bad "install/uninstall.sh failed"; }
left=$(for f in $files; do [ ! -e "$f" ] || echo "$f"; done)
[ -z "$left" ] && [ ! -e "$manifest" ] && ok "uninstall removed the installed files and the manifest" \
  || bad "uninstall left: $left $( [ -e "$manifest" ] && echo "$manifest")"
if [ -d "$dir/etc-containerd-before" ]; then
  diff -r "$dir/etc-containerd-before" /etc/containerd > "$dir/uninstall-config.diff" \
    && ok "uninstall put /etc/containerd back as it was before the install" \
    || { bad "/etc/containerd after uninstall differs from before the install:"; cat "$dir/uninstall-config.diff"; }
else
  [ ! -e /etc/containerd/config.toml ] && [ ! -e /etc/containerd/conf.d ] \
    && ok "uninstall removed the config it created" || bad "uninstall left config in /etc/containerd"
fi
bash install/install.sh --no-deps --from "$from" > "$dir/install-3.log" 2>&1 || { cat "$dir/install-3.log"; bad "install after uninstall failed"; }
state > "$dir/state-3"
diff <(without_mtimes < "$dir/state-1") <(without_mtimes < "$dir/state-3") > "$dir/state-1-3.diff" \
  && ok "install after uninstall gives the same files, config and packages" \
  || { bad "install after uninstall differs from the first:"; cat "$dir/state-1-3.diff"; }

# 4. config merge, in scratch roots
scratch=$(mktemp -d /tmp/gpucr-merge.XXXXXX)
real_containerd=$(command -v containerd)
mkdir -p "$scratch/fake2"
# containerd 2.x as far as install.sh's version check goes. Its `config dump` shows the files
# themselves: 1.x cannot read version 3 and merges imports differently (containerd 2.1.9's own
# dump of these merges, checked by hand: config.toml's CRI settings stay, gpucr and runc are there).
cat > "$scratch/fake2/containerd" <<'EOF'
#!/bin/sh
[ "$1" = --version ] && { echo "containerd github.com/containerd/containerd/v2 v2.1.4 fake"; exit 0; }
[ "$1" = --config ] && [ "$3 $4" = "config dump" ] && { cat "$2" "$(dirname "$2")"/conf.d/*.toml; exit 0; }
echo "fake containerd: $*" >&2; exit 1
EOF
chmod +x "$scratch/fake2/containerd"
debian_v2_cfg='version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"'
merge() {  # merge NAME PATH-PREFIX [CONFIG-TEXT|-]: install into $scratch/NAME; rc of install.sh
  local root="$scratch/$1"
  mkdir -p "$root/etc/containerd"
  [ "${3:--}" = - ] || printf '%s\n' "$3" > "$root/etc/containerd/config.toml"
  [ -f "$root/etc/containerd/config.toml" ] && cp "$root/etc/containerd/config.toml" "$root.orig"
  PATH="$2$PATH" GPUCR_DESTDIR="$root" bash install/install.sh --no-deps --from "$from" > "$root.log" 2>&1
}
cfg_of() { echo "$scratch/$1/etc/containerd/config.toml"; }
dropin_of() { echo "$scratch/$1/etc/containerd/conf.d/gpucr.toml"; }

if merge v2on2 "$scratch/fake2:" "$debian_v2_cfg" \
  && cmp -s "$(dropin_of v2on2)" install/containerd/gpucr-v2.toml \
  && diff <(grep -v -e '^imports = ' -e '^# added by gpucr' "$(cfg_of v2on2)") "$scratch/v2on2.orig" >/dev/null \
  && grep -qxF "imports = [\"$scratch/v2on2/etc/containerd/conf.d/*.toml\"]" "$(cfg_of v2on2)"; then
  ok "merge: version-2 config.toml on containerd 2.x gets the v2 drop-in, imported; the rest of config.toml unchanged"
else
  bad "merge: v2 config on 2.x"; cat "$scratch/v2on2.log"; cat "$(cfg_of v2on2)"
fi
if merge none2 "$scratch/fake2:" - && cmp -s "$(dropin_of none2)" install/containerd/gpucr-v3.toml \
  && grep -q '^version = 3$' "$(cfg_of none2)"; then
  ok "merge: no config.toml on containerd 2.x: a version-3 config.toml and the v3 drop-in"
else
  bad "merge: no config on 2.x"; cat "$scratch/none2.log"
fi
if merge none17 "" - && [ ! -e "$(dropin_of none17)" ] && grep -q '^version = 2$' "$(cfg_of none17)" \
  && "$real_containerd" --config "$(cfg_of none17)" config dump 2>/dev/null | grep -q 'runtime_type = "io.containerd.gpucr.v2"'; then
  ok "merge: no config.toml on containerd 1.x: a version-2 config.toml holding the runtime class"
else
  bad "merge: no config on 1.x"; cat "$scratch/none17.log"
fi
# containerd 1.x replaces a whole plugin section with an imported one: the runtime class must go
# into config.toml itself and keep every CRI setting there.
if [ "$("$real_containerd" --version | awk '{print $3}' | sed 's/^v//; s/\..*//')" = 1 ]; then
  cri_cfg='version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "example/pause:9"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = true
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.other]
      runtime_type = "io.containerd.runc.v2"'
  for c in debian cri; do
    if [ $c = debian ]; then text=$debian_v2_cfg; else text=$cri_cfg; fi
    dump=""
    merge "v2on17$c" "" "$text" && dump=$("$real_containerd" --config "$(cfg_of "v2on17$c")" config dump 2>&1 || true)
    want=('runtime_type = "io.containerd.gpucr.v2"' 'containerd.runtimes.runc]')
    if [ $c = cri ]; then want+=('sandbox_image = "example/pause:9"' 'SystemdCgroup = true' 'containerd.runtimes.other]')
    else want+=('path = "/var/lib/containerd/opt"' 'bin_dir = "/usr/lib/cni"'); fi
    missing=""; for w in "${want[@]}"; do grep -qF "$w" <<<"$dump" || missing+=" [$w]"; done
    if [ -z "$missing" ] && [ ! -e "$(dropin_of "v2on17$c")" ] \
      && GPUCR_DESTDIR="$scratch/v2on17$c" bash install/uninstall.sh > "$scratch/v2on17$c-un.log" 2>&1 \
      && cmp -s "$scratch/v2on17$c.orig" "$(cfg_of "v2on17$c")"; then
      ok "merge: $c version-2 config.toml on containerd 1.x: config dump keeps its settings, adds gpucr (and runc); uninstall restores it byte for byte"
    else
      bad "merge: $c v2 config on 1.x: missing in config dump:${missing:- none}, or uninstall did not restore it"; cat "$scratch/v2on17$c.log"
    fi
  done
fi
if [ "$("$real_containerd" --version | awk '{print $3}' | sed 's/^v//; s/\..*//')" = 1 ]; then
  if ! merge v3on17 "" "version = 3" && [ ! -e "$scratch/v3on17/var/lib/gpucr/install-manifest" ] \
    && cmp -s "$scratch/v3on17.orig" "$(cfg_of v3on17)"; then
    ok "merge: a version-3 config.toml on containerd 1.x is refused, nothing installed"
  else
    bad "merge: v3 config on 1.x was not refused cleanly"; cat "$scratch/v3on17.log"
  fi
fi
if ! merge v1 "" '[plugins.cri]' && [ ! -e "$scratch/v1/var/lib/gpucr/install-manifest" ] \
  && cmp -s "$scratch/v1.orig" "$(cfg_of v1)"; then
  ok "merge: a version-less (v1) config.toml is refused, nothing installed"
else
  bad "merge: v1 config was not refused cleanly"; cat "$scratch/v1.log"
fi
if merge empty "$scratch/fake2:" "version = 2
imports = []
$(printf '%s\n' "$debian_v2_cfg" | sed 1d)" && grep -qF "imports = [\"$scratch/empty/etc/containerd/conf.d/*.toml\"]" "$(cfg_of empty)" \
  && GPUCR_DESTDIR="$scratch/empty" bash install/uninstall.sh > "$scratch/empty-un.log" 2>&1 \
  && cmp -s "$scratch/empty.orig" "$(cfg_of empty)" && [ ! -e "$(dropin_of empty)" ]; then
  ok "merge: 'imports = []' gets the drop-in glob; uninstall restores the file byte for byte"
else
  bad "merge: imports = [] case"; cat "$scratch/empty.log" "$scratch/empty-un.log" 2>/dev/null
fi
rm -rf "$scratch"

if [ "$fail" = 0 ]; then echo "node-unchanged: OK"; else echo "node-unchanged: FAILED"; exit 1; fi
