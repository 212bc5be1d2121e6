#!/usr/bin/env bash
# Regenerates gpuhash.ptx from gpuhash.cu with clang (no CUDA toolkit needed; Debian: clang-19).
# The PTX is committed, so building gpucr needs neither clang nor nvcc; the driver JIT-compiles
# it for the GPU at hand (sm_70 and newer). After a change, run the GPU check:
# tests/gpu/h200-hook.sh compares the kernel's digests with the CPU reference.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
CLANG=${CLANG:-clang-19}
"$CLANG" -x cuda --cuda-device-only --cuda-gpu-arch=sm_70 -Xclang -target-feature -Xclang +ptx70 \
  -nocudainc -nocudalib -O3 -S -o gpuhash.ptx gpuhash.cu
echo "wrote $(pwd)/gpuhash.ptx"
