#!/usr/bin/env bash
# The test command (README; CI runs it through .ci/run): installs the runtime dependencies
# (install/deps.sh) and gpucr itself (install/install.sh), checks that the install changed no
# installed package and is idempotent and undoable (tests/node-unchanged.sh), builds the workspace
# and runs every test, including the end-to-end suite in tests/ (real containerd + runc + CRIU,
# driven through ctr) against the installed shim in /usr/local/bin, and the CRI suite against
# containerd 2.x unpacked beside the node's 1.7 (tests/containerd2.sh); then the checkpoint,
# lifecycle, io, task_api_client and deadlines suites again against that 2.x; the store's shared
# store tests run against a real S3 server (s3s-fs, built from crates.io into /opt/gpucr-test/s3s).
# Runs as root (or re-runs itself with sudo) on a fresh Debian 12 (or newer) clone; needs only
# apt packages and crates.io.
#
# Environment:
#   GPUCR_TEST_RUNTIME  runtime the end-to-end tests drive (default io.containerd.gpucr.v2;
#                       io.containerd.runc.v2 checks the harness against the stock runc shim)
#   TEST_THREADS        parallel test threads (default 2)
set -euo pipefail

cd "$(dirname "$0")/.."
repo=$(pwd)
# Re-run with sudo when not root (a rustup cargo in the caller's ~/.cargo/bin is still found).
gpucr_tag="gpucr CI"
# shellcheck source=install/lib.sh
. install/lib.sh
gpucr_as_root "$repo/tests/run.sh" "$@"
export DEBIAN_FRONTEND=noninteractive
started=$(date +%s)
log_dir=$(mktemp -d /tmp/gpucr-ci.XXXXXX)
step() { printf '\n==== %s (%ss) ====\n' "$*" "$(($(date +%s) - started))"; }

step "install dependencies (install/deps.sh: changes no installed package)"
bash tests/node-unchanged.sh snapshot-packages "$log_dir/node"
bash install/deps.sh
# Build tools for crates with C parts; script(1) (util-linux/bsdutils) for the terminal tests;
# ip(8) for the second node's network namespace (tests/tests/store_s3.rs).
gpucr_apt_install_new build-essential pkg-config ca-certificates bsdutils iproute2

if ! gpucr_find_cargo; then
  step "install cargo from the release (no cargo on PATH or in ~/.cargo/bin)"
  gpucr_apt_install_new cargo rustc
fi
command -v cargo >/dev/null || { echo "gpucr CI: no cargo available" >&2; exit 2; }
cargo --version
rustc --version
# Under sudo, cargo builds as the user who owns the checkout (target/ and ~/.cargo stay theirs);
# only the tests, which need root, run as root (offline: everything is fetched by then).
as_owner=()
offline=()
if [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ] && [ "$(stat -c %U "$repo")" = "$SUDO_USER" ]; then
  as_owner=(runuser -u "$SUDO_USER" -- env PATH="$PATH" HOME="$(gpucr_sudo_home)")
  offline=(--offline)
fi

step "criu check"
criu check || echo "gpucr CI: warning: criu check failed; checkpoint tests will fail"

if [ -f /var/lib/gpucr/install-manifest ]; then
  # The check below compares with the node before gpucr's install: start from one without it.
  step "remove the previous gpucr install (install/uninstall.sh)"
  bash install/uninstall.sh
fi
step "install gpucr (install/install.sh: binaries, CRIU plugin, hook, containerd runtime class)"
bash tests/node-unchanged.sh snapshot-config "$log_dir/node"
bash install/install.sh --no-deps

step "the install leaves the node alone (tests/node-unchanged.sh)"
# A failure here fails the run at the end; the test suite still runs.
node_status=0
bash tests/node-unchanged.sh check "$log_dir/node" 2>&1 | tee "$log_dir/node-unchanged.log" || node_status=1

step "build (release)"
"${as_owner[@]}" cargo build --release --workspace
"${as_owner[@]}" cargo test --release --workspace --no-run

step "containerd 2.x and checkpointctl beside the node's (tests/containerd2.sh: node untouched)"
# Debian sid's containerd 2.x and trixie's checkpointctl, unpacked into /opt/gpucr-test; the CRI
# suite runs against that 2.x, and the ctr suites run a second time against it below.
if bash tests/containerd2.sh 2>&1 | tee "$log_dir/containerd2.log"; then
  eval "$(grep -E '^GPUCR_(TEST_CONTAINERD2|CHECKPOINTCTL)=' "$log_dir/containerd2.log" | sed 's/^/export /')"
else
  echo "gpucr CI: tests/containerd2.sh failed: the CRI suite and the containerd 2.x pass fail"
fi

step "an S3-compatible server for the shared store's tests (s3s-fs from crates.io, into /opt/gpucr-test/s3s)"
# A real S3 server (not a mock) on loopback; store/tests/s3.rs starts it. Built once (~2 min).
if [ ! -x /opt/gpucr-test/s3s/bin/s3s-fs ]; then
  CARGO_TARGET_DIR=/var/tmp/gpucr-s3s-build cargo install s3s-fs@0.14.1 --features binary --locked \
    --root /opt/gpucr-test/s3s 2>&1 | tail -3 || echo "gpucr CI: s3s-fs did not build; the S3 store test fails"
  rm -rf /var/tmp/gpucr-s3s-build
fi

step "test"
# The installed layout: the shim and gpucr-copyin where install.sh put them.
export GPUCR_SHIM_DIR=/usr/local/bin
export GPUCR_TEST_RUNTIME="${GPUCR_TEST_RUNTIME:-io.containerd.gpucr.v2}"
echo "runtime under test: $GPUCR_TEST_RUNTIME; shim dir: $GPUCR_SHIM_DIR"
set +e
cargo test "${offline[@]}" --release --workspace --no-fail-fast -- --test-threads="${TEST_THREADS:-2}" 2>&1 \
  | tee "$log_dir/test.log"
status=${PIPESTATUS[0]}
set -e

step "the ctr and Task API suites again against containerd 2.x (checkpoint, lifecycle, io, task_api_client, deadlines, store_ref, store_s3)"
# About 2 minutes on 2 cores; the CRI suites (tests/tests/cri.rs, cri_gpu_fake.rs) ran above, on
# 2.x by themselves.
set +e
c2_status=0
if [ -n "${GPUCR_TEST_CONTAINERD2:-}" ]; then
  GPUCR_TEST_CONTAINERD=$GPUCR_TEST_CONTAINERD2 cargo test "${offline[@]}" --release -p gpucr-tests \
    --no-fail-fast --test checkpoint --test lifecycle --test io --test task_api_client --test deadlines --test store_ref --test store_s3 \
    -- --test-threads="${TEST_THREADS:-2}" 2>&1 | tee "$log_dir/test-containerd2.log"
  c2_status=${PIPESTATUS[0]}
else
  c2_status=1
fi
set -e

step "summary"
echo "runtime under test: $GPUCR_TEST_RUNTIME"
grep -E '^\s+Running |^test result:' "$log_dir/test.log" \
  | sed -E 's#^\s+Running ([^ ]+).*#\1#' || true
passed=$(grep -Eo '[0-9]+ passed' "$log_dir/test.log" | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed' "$log_dir/test.log" | awk '{s+=$1} END {print s+0}')
ignored=$(grep -Eo '[0-9]+ ignored' "$log_dir/test.log" | awk '{s+=$1} END {print s+0}')
echo "passed: $passed, failed: $failed, ignored: $ignored"
[ "$node_status" = 0 ] || echo "node-unchanged: FAILED (see $log_dir/node-unchanged.log)"
c2_passed=$(grep -Eo '[0-9]+ passed' "$log_dir/test-containerd2.log" 2>/dev/null | awk '{s+=$1} END {print s+0}')
c2_failed=$(grep -Eo '[0-9]+ failed' "$log_dir/test-containerd2.log" 2>/dev/null | awk '{s+=$1} END {print s+0}')
echo "containerd 2.x pass: passed: $c2_passed, failed: $c2_failed (log: $log_dir/test-containerd2.log)"
if [ "$failed" != 0 ] || [ "$status" != 0 ] || [ "$node_status" != 0 ] || [ "$c2_status" != 0 ]; then
  echo "failed tests:"
  grep -E '^test .* FAILED$' "$log_dir/test.log" | sed 's/^/  /' || true
  grep -E '^test .* FAILED$' "$log_dir/test-containerd2.log" 2>/dev/null | sed 's/^/  (containerd 2.x) /' || true
  echo "gpucr CI: FAILED (exit $status) after $(($(date +%s) - started))s; log: $log_dir/test.log"
  exit 1
fi
echo "gpucr CI: OK after $(($(date +%s) - started))s"
