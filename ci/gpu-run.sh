#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, what ci/gpu-stage.sh staged in .gpu/:
#   bash .gpu/gpu-run.sh [tests] [examples] [bench] [bench-quick] [bench-large] [bench-procs]
#                        [interference] [weights] [weights-procs] [one-gpu] [python]
#                        [python-bench] [threads-channels] [budget] [abab] [sanitizers]
#                        (default: tests examples)
# sanitizers: compute-sanitizer memcheck over the GPU test binaries that fit its slowdown
# (one_queue, owned_graph, chain, corners but its three timing-bound tests), racecheck over
# one_queue and chain, synccheck over one_queue; each fails on any error it reports. API error
# reports are off (`--report-api-errors no`): NCCL's own cudaFuncGetAttributes probes return
# cudaErrorNoKernelImageForDevice, 8 reports in corners (085c965), none a memory error.
# one-gpu: what one GPU can measure (results/h200x1, results/h200x1-shared): the NCCL path of a
# 1-GPU clique against a bare ncclBroadcast and with its watchdog off (eager, graph, idle), the
# cost of cudarc's per-buffer events on a 2-rank P2P call, and the timer test, also with the
# old polled timer (expected to fail).
# budget: the call-cost budget on one GPU (results/README.md, "The cost of a call"): the NCCL path
# of a 1-GPU clique against a raw ncclBroadcast, with cudarc's event tracking and the watchdog
# each on and off, and the launch floor, interleaved, eager, after 10 ms idle and in graphs,
# RUNS times (default 4); then P2P with two ranks sharing the GPU, tracked and untracked. Each
# run writes budget.md, table.txt and broadcast.csv, stamped.
# Logs are packed into $OUT/logs.tgz and the benchmarks' CSV, tables and plots into
# $OUT/results.tgz (the device tool returns at most 8 files); a summary table is printed last.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# NVLink multicast stays off on shared machines, in this process and every child.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# What the benchmarks write in their headers: the commit ci/gpu-stage.sh built from.
[ -f .gpu/COMMIT ] && export GPUCAST_COMMIT=$(cat .gpu/COMMIT)
dest=${OUT:-.gpu/out}
out=$(mktemp -d /tmp/gpucast-logs.XXXX)
res=$(mktemp -d /tmp/gpucast-results.XXXX)
mkdir -p "$dest"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests examples)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m | head -5
summary=()
run() {
  local name=$1; shift
  local t0=$(date +%s%N)
  timeout -k 10 "${LIMIT:-300}" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  local dt="$((ms / 1000)).$(( (ms % 1000) / 100 ))"
  if [ $rc -eq 0 ]; then
    summary+=("$(printf '%-44s %-6s %8ss  %s' "$name" ok "$dt" "$(grep -E '^test result|tests? passed|checked|GB/s' "$out/$name.log" | tail -1 | cut -c1-90)")")
  else
    summary+=("$(printf '%-44s %-6s %8ss  see %s.log' "$name" "FAIL($rc)" "$dt" "$name")")
    echo "==== $name failed (rc $rc); last lines:"; tail -40 "$out/$name.log"
  fi
}

if want sanitizers; then
  cs="/usr/local/cuda/bin/compute-sanitizer --report-api-errors no --error-exitcode 9"
  for t in one_queue owned_graph chain; do
    LIMIT=300 run "memcheck-$t" $cs --tool memcheck ".gpu/bin/test-$t-test" --include-ignored --test-threads 1
  done
  LIMIT=400 run memcheck-corners $cs --tool memcheck .gpu/bin/test-corners-test \
    --include-ignored --test-threads 1 --skip nccl_calls_queued --skip a_captured_call --skip dropping_a_clique
  for t in one_queue chain; do
    LIMIT=300 run "racecheck-$t" $cs --tool racecheck ".gpu/bin/test-$t-test" --include-ignored --test-threads 1
  done
  LIMIT=300 run synccheck-one_queue $cs --tool synccheck .gpu/bin/test-one_queue-test --include-ignored --test-threads 1
fi
if want tests; then
  for t in .gpu/bin/test-*; do
    run "$(basename "$t")" "$t" --include-ignored --test-threads 1
  done
fi
if want examples; then
  run example-broadcast .gpu/bin/example-broadcast
  run example-broadcast-1gpu env CUDA_VISIBLE_DEVICES=0 .gpu/bin/example-broadcast
fi
if want weights; then
  run example-weights .gpu/bin/example-broadcast_weights --compare
  run example-weights-100M .gpu/bin/example-broadcast_weights --compare --size 100M
fi
if want python || want python-bench; then
  # The Python package staged by ci/gpu-stage.sh, with pytest carried in .gpu/pylib.
  export PYTHONPATH=$PWD/.gpu/py:$PWD/.gpu/pylib
  shared=$([ "$(nvidia-smi -L | wc -l)" -lt 2 ] && echo --shared)
fi
if want python; then
  # The tests (test_groups_gpu.py among them: explicit groups, the torch backend, the
  # weight-sync example and mismatches, every process on GPU 0).
  LIMIT=450 run python-tests python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -o faulthandler_timeout=200 --durations=0 .gpu/py/tests
  run python-weight-sync python3 -m torch.distributed.run --standalone --nproc-per-node 2 .gpu/py/examples/weight_sync.py $shared --size 256M
  # A trainer (python) and two workers (torchrun) in one explicit group, then through the torch
  # backend; the multicast variables above are exported to every process they start.
  run python-rl-weight-sync python3 .gpu/py/examples/rl_weight_sync.py --workers 2 --size 1G --steps 3
  run python-rl-weight-sync-torch python3 .gpu/py/examples/rl_weight_sync.py --workers 2 --size 1G --steps 3 --door torch
  run python-rl-weight-sync-mismatch python3 .gpu/py/examples/rl_weight_sync.py --workers 2 --size 64M --mismatch --timeout 5
fi
if want python-bench; then
  run python-bench-clique python3 .gpu/py/bench/broadcast.py --clique "$([ -n "$shared" ] && echo 0,0 || echo 0,1)" -e 64M --out "$out/py-clique"
  run python-bench-procs python3 -m torch.distributed.run --standalone --nproc-per-node 2 .gpu/py/bench/broadcast.py -e 64M --out "$out/py-procs"
  for d in py-clique py-procs; do
    for f in broadcast.csv table.txt; do cp "$out/$d/$f" "$res/$d-$f" 2>/dev/null; done
  done
fi
if want weights-procs; then
  run example-weights-procs .gpu/bin/example-broadcast_weights --procs 2
  run example-weights-procs-100M .gpu/bin/example-broadcast_weights --procs 2 --size 100M
fi
if want bench-quick; then
  run bench-quick .gpu/bin/bench-broadcast --bench -e 64M --repeats 7 --target-ms 10 --out "$out/bench-quick" --torch no \
    --paths nccl,p2p,p2p-packet,p2p-pull,auto,copy-engine,launch-floor
  cp "$out/bench-quick/table.txt" "$res/bench-quick-table.txt" 2>/dev/null
  cp "$out/bench-quick/broadcast.csv" "$res/bench-quick.csv" 2>/dev/null
fi
if want bench-large; then
  run bench-large .gpu/bin/bench-broadcast --bench -b 256K -e 1G --paths nccl,p2p,p2p-chain,copy-engine,copy-engine-raw,auto --repeats 9 --target-ms 10 --out "$out/bench-large" --torch no
  for f in broadcast.csv broadcast.png table.txt; do cp "$out/bench-large/$f" "$res/bench-large-$f" 2>/dev/null; done
fi
if want one-gpu; then
  run one-gpu-nccl .gpu/bin/bench-broadcast --bench --gpus 1 -b 1K -e 1M -f 4 \
    --paths nccl,nccl-raw,nccl-nowatch,launch-floor --modes eager,idle,graph --torch no \
    --out "$out/one-gpu-nccl"
  run one-gpu-tracking .gpu/bin/bench-broadcast --bench --shared -b 1K -e 64K \
    --paths p2p,p2p-untracked,launch-floor --modes eager --torch no --out "$out/one-gpu-tracking"
  for d in one-gpu-nccl one-gpu-tracking; do
    for f in broadcast.csv table.txt; do cp "$out/$d/$f" "$res/$d-$f" 2>/dev/null; done
  done
  run timer .gpu/bin/test-timer-test --include-ignored --nocapture
  run timer-polled-expected-to-fail env GPUCAST_TEST_TIMER=polled .gpu/bin/test-timer-test --include-ignored --nocapture
fi
if want abab; then
  # The bench of BASE (ci/gpu-stage.sh with BASE=<commit>) and of this commit, interleaved
  # (base, new, new, base): per-call costs of the NCCL path of a 1-GPU clique and of P2P with
  # two ranks on GPU 0, eager, 1 KiB and 64 KiB. Each table says which binary wrote it.
  for step in base-1 new-1 new-2 base-2; do
    b=${step%-*}; bin=.gpu/bin/$([ "$b" = base ] && echo base-bench || echo bench-broadcast)
    run "abab-nccl-$step" "$bin" --bench --gpus 1 -b 1K -e 64K -f 64 --paths nccl,nccl-raw,launch-floor \
      --modes eager --torch no --out "$out/abab-nccl-$step"
    run "abab-p2p-$step" "$bin" --bench --shared -b 1K -e 64K -f 64 --paths p2p,launch-floor \
      --modes eager --torch no --out "$out/abab-p2p-$step"
  done
  for d in "$out"/abab-*; do
    { echo "# binary: $(basename "$d" | sed 's/abab-[a-z0-9]*-//'), base $(cat .gpu/BASE 2>/dev/null), new $(cat .gpu/COMMIT)"; cat "$d/table.txt"; } \
      >"$res/$(basename "$d")-table.txt" 2>/dev/null
  done
fi
if want budget; then
  for i in $(seq "${RUNS:-4}"); do
    run "budget-nccl-$i" .gpu/bin/bench-broadcast --bench --gpus 1 -b 1K -e 64K -f 4 \
      --paths nccl,nccl-raw,nccl-nowatch,nccl-untracked,nccl-untracked-nowatch,launch-floor \
      --modes eager,idle,graph --torch no --out "$out/budget-nccl-$i"
  done
  run budget-p2p .gpu/bin/bench-broadcast --bench --shared -b 1K -e 64K -f 4 \
    --paths p2p,p2p-untracked,launch-floor --modes eager,idle,graph --torch no --out "$out/budget-p2p"
  for d in "$out"/budget-*; do
    for f in budget.md table.txt broadcast.csv; do cp "$d/$f" "$res/$(basename "$d")-$f" 2>/dev/null; done
  done
fi
if want threads-channels; then
  # The threads test (two ranks of one GPU, four threads) run again and again with the device's
  # hardware work queues set to 1, the default (8) and 32: streams beyond that number share a
  # queue, where work of one stream can hold back the next kernel of another.
  for c in 1 8 32; do
    pass=0; fail=0
    for i in $(seq "${RUNS:-5}"); do
      if CUDA_DEVICE_MAX_CONNECTIONS=$c timeout -k 5 60 .gpu/bin/test-promises-test --include-ignored \
          --exact threads_share_a_clique_whose_ranks_share_a_gpu >"$out/threads-c$c-$i.log" 2>&1; then
        pass=$((pass + 1))
      else
        fail=$((fail + 1))
      fi
    done
    summary+=("$(printf '%-44s %s passed, %s failed' "threads, CUDA_DEVICE_MAX_CONNECTIONS=$c" $pass $fail)")
  done
fi
if want bench; then
  run bench .gpu/bin/bench-broadcast --bench --out "$out/bench" --python python3
  for f in broadcast.csv broadcast.png table.txt torch.csv partial.csv; do cp "$out/bench/$f" "$res/bench-$f" 2>/dev/null; done
fi
if want interference; then
  run interference .gpu/bin/bench-broadcast --bench --interference --out "$out/interference"
  for f in interference.csv interference.txt interference.png; do cp "$out/interference/$f" "$res/$f" 2>/dev/null; done
fi
if want bench-procs; then
  run bench-procs .gpu/bin/bench-broadcast --bench --procs 2 --out "$out/bench-procs" --python python3
  for f in "$out"/bench-procs/*; do cp "$f" "$res/procs-$(basename "$f")" 2>/dev/null; done
fi

tar czf "$dest/logs.tgz" -C "$out" . 2>/dev/null
[ -n "$(ls -A "$res")" ] && tar czf "$dest/results.tgz" -C "$res" .
echo
echo "==== summary"
printf '%s\n' "${summary[@]}"
