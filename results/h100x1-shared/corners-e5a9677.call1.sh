#!/usr/bin/env bash
# The device command of results/h100x1-shared/corners-e5a9677.md (`bash .gpu/call1.sh`, with
# .gpu staged by `bash ci/gpu-stage.sh` at e5a9677 and .gpu/bin/old-corners built from e287451
# with tests/corners.rs of e5a9677 added).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/c
timeout -k 5 240 .gpu/bin/old-corners --include-ignored --test-threads 1 >$OUT/c/corners-old.log 2>&1
timeout -k 5 240 .gpu/bin/test-corners-test --include-ignored --test-threads 1 --nocapture >$OUT/c/corners-new.log 2>&1
CUDA_DEVICE_MAX_CONNECTIONS=1 timeout -k 5 240 .gpu/bin/test-corners-test --include-ignored --test-threads 1 --nocapture >$OUT/c/corners-new-1q.log 2>&1
LIMIT=200 OUT=$OUT bash .gpu/gpu-run.sh tests
