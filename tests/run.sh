#!/usr/bin/env bash
# The test command (README; CI runs it through .ci/run): installs the runtime dependencies, builds the workspace and runs every test,
# including the end-to-end suite in tests/ (real containerd + runc + CRIU, driven through ctr).
# Runs as root on a fresh Debian 12 (or newer) clone; needs only apt packages and crates.io.
#
# Environment:
#   GPUCR_TEST_RUNTIME  runtime the end-to-end tests drive (default io.containerd.gpucr.v2;
#                       io.containerd.runc.v2 checks the harness against the stock runc shim)
#   TEST_THREADS        parallel test threads (default 2)
set -euo pipefail

cd "$(dirname "$0")/.."
repo=$(pwd)
started=$(date +%s)
log_dir=$(mktemp -d /tmp/gpucr-ci.XXXXXX)
step() { printf '\n==== %s (%ss) ====\n' "$*" "$(($(date +%s) - started))"; }

if [ "$(id -u)" != 0 ]; then
  echo "gpucr CI: must run as root (containerd, runc and CRIU need it)" >&2
  exit 2
fi

step "install dependencies"
bash install/deps.sh
export DEBIAN_FRONTEND=noninteractive
# Build tools for crates with C parts; script(1) (util-linux/bsdutils) for the terminal tests.
apt-get install -y -qq build-essential pkg-config ca-certificates bsdutils >/dev/null

if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    step "install cargo from Debian (no cargo on PATH)"
    apt-get install -y -qq -t trixie cargo rustc >/dev/null 2>&1 \
      || apt-get install -y -qq cargo rustc >/dev/null
  fi
fi
command -v cargo >/dev/null || { echo "gpucr CI: no cargo available" >&2; exit 2; }
cargo --version
rustc --version

step "criu check"
criu check || echo "gpucr CI: warning: criu check failed; checkpoint tests will fail"

step "build (release)"
cargo build --release --workspace
cargo test --release --workspace --no-run

step "test"
export GPUCR_SHIM_DIR="$repo/target/release"
export GPUCR_TEST_RUNTIME="${GPUCR_TEST_RUNTIME:-io.containerd.gpucr.v2}"
echo "runtime under test: $GPUCR_TEST_RUNTIME; shim dir: $GPUCR_SHIM_DIR"
set +e
cargo test --release --workspace --no-fail-fast -- --test-threads="${TEST_THREADS:-2}" 2>&1 \
  | tee "$log_dir/test.log"
status=${PIPESTATUS[0]}
set -e

step "summary"
echo "runtime under test: $GPUCR_TEST_RUNTIME"
grep -E '^\s+Running |^test result:' "$log_dir/test.log" \
  | sed -E 's#^\s+Running ([^ ]+).*#\1#' || true
passed=$(grep -Eo '[0-9]+ passed' "$log_dir/test.log" | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed' "$log_dir/test.log" | awk '{s+=$1} END {print s+0}')
ignored=$(grep -Eo '[0-9]+ ignored' "$log_dir/test.log" | awk '{s+=$1} END {print s+0}')
echo "passed: $passed, failed: $failed, ignored: $ignored"
if [ "$failed" != 0 ] || [ "$status" != 0 ]; then
  echo "failed tests:"
  grep -E '^test .* FAILED$' "$log_dir/test.log" | sed 's/^/  /' || true
  echo "gpucr CI: FAILED (exit $status) after $(($(date +%s) - started))s; log: $log_dir/test.log"
  exit 1
fi
echo "gpucr CI: OK after $(($(date +%s) - started))s"
