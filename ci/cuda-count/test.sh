#!/usr/bin/env bash
# Checks the counting shim against a fake driver (test/fake_driver.c), no GPU or CUDA needed:
#   bash ci/cuda-count/test.sh
# Builds the shim and the fake into a temporary directory, then runs test/test_main.c, which
# opens the shim by name as cudarc and cudart do and checks that return values, register and
# stack arguments and out pointers pass through, that a name the driver lacks returns 500, that
# cuGetProcAddress_v2 hands out counting pointers, that counts are exact across threads, and
# that GPUCAST_COUNT_DUMP=1 prints them at exit. Exits non-zero on any failure.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

bash "$here/build.sh" "$tmp/shim" >/dev/null
gcc -O2 -fPIC -shared -Wall -Wextra -Werror -o "$tmp/libfakecuda.so" "$here/test/fake_driver.c"
gcc -O2 -Wall -Wextra -Werror -o "$tmp/test_main" "$here/test/test_main.c" -ldl -lpthread

export LD_LIBRARY_PATH="$tmp/shim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export GPUCAST_REAL_LIBCUDA="$tmp/libfakecuda.so"
"$tmp/test_main"

# The dump at exit: the counts of the run above.
GPUCAST_COUNT_DUMP=1 "$tmp/test_main" >/dev/null 2>"$tmp/dump"
grep -q "driver $tmp/libfakecuda.so, 5 of" "$tmp/dump"
grep -Eq '^gpucast-count: +800003 cuInit$' "$tmp/dump"
grep -Eq '^gpucast-count: +2 cuHidden@proc$' "$tmp/dump"
grep -Eq '^gpucast-count: +800016 total$' "$tmp/dump"

# The shim refuses itself as the real driver, and without a driver every call returns 500.
GPUCAST_REAL_LIBCUDA="$tmp/shim/libcuda.so.1" "$tmp/test_main" nodriver 2>"$tmp/self"
grep -q "is the counting shim, not the driver" "$tmp/self"
echo "cuda-count: dump and driver checks passed"
