#!/usr/bin/env bash
# Builds a busybox OCI image by hand (no registry is needed) and imports it into containerd.
# usage: busybox-image.sh [image-name] [ctr args...]   e.g. busybox-image.sh docker.io/library/busybox:gpucr -n default
set -euo pipefail
name=${1:-docker.io/library/busybox:gpucr}; shift || true
bb=$(command -v busybox) || { echo "busybox not found: apt-get install busybox-static" >&2; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/rootfs/bin" "$work/rootfs/tmp" "$work/rootfs/proc" "$work/rootfs/sys" "$work/rootfs/dev" "$work/rootfs/etc"
cp "$bb" "$work/rootfs/bin/busybox"
for applet in $("$bb" --list); do [ "$applet" = busybox ] || ln -sf busybox "$work/rootfs/bin/$applet"; done
echo 'root:x:0:0:root:/:/bin/sh' > "$work/rootfs/etc/passwd"
echo 'root:x:0:' > "$work/rootfs/etc/group"
mkdir -p "$work/oci/blobs/sha256"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/rootfs" -cf "$work/layer.tar" .
diff_id=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
gzip -n -c "$work/layer.tar" > "$work/layer.tar.gz"
layer=$(sha256sum "$work/layer.tar.gz" | cut -d' ' -f1); layer_size=$(stat -c %s "$work/layer.tar.gz")
mv "$work/layer.tar.gz" "$work/oci/blobs/sha256/$layer"
printf '{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/bin"],"Cmd":["sh"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' "$diff_id" > "$work/config.json"
cfg=$(sha256sum "$work/config.json" | cut -d' ' -f1); cfg_size=$(stat -c %s "$work/config.json")
mv "$work/config.json" "$work/oci/blobs/sha256/$cfg"
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s}]}' \
  "$cfg" "$cfg_size" "$layer" "$layer_size" > "$work/manifest.json"
man=$(sha256sum "$work/manifest.json" | cut -d' ' -f1); man_size=$(stat -c %s "$work/manifest.json")
mv "$work/manifest.json" "$work/oci/blobs/sha256/$man"
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"%s"}}]}' \
  "$man" "$man_size" "$name" > "$work/oci/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' > "$work/oci/oci-layout"
tar -C "$work/oci" -cf "$work/image.tar" .
ctr "$@" image import --index-name "$name" "$work/image.tar" >/dev/null
echo "$name"
