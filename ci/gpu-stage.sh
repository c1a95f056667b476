#!/usr/bin/env bash
# Builds (here, no GPU needed) everything the GPU machine runs and stages it in .gpu/, which git
# ignores: the GPU test executables, the examples, the benchmark and the scripts. The device call
# then carries .gpu and runs `bash .gpu/gpu-run.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu
mkdir -p .gpu/bin

json=$(mktemp)
cargo test --release --no-run --message-format=json >"$json"
cargo bench --no-run --message-format=json >>"$json"
cargo build --release --examples

# Test and bench executables: name them after their target.
python3 - "$json" <<'PY'
import json, shutil, sys, os
seen = set()
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kind = m["target"]["kind"][0]
    name = m["target"]["name"]
    # Tests that need no GPU (CI runs them): left out, to keep the staging under the 64 MiB a
    # device call carries.
    if name in ("hostile_store", "no_gpu", "bench_report", "gpucast_rendezvous"):
        continue
    if kind == "bench":
        dest = f".gpu/bin/bench-{name}"
    elif m["profile"]["test"] and kind in ("test", "lib"):
        dest = f".gpu/bin/test-{name}-{kind}"
    else:
        continue
    if dest in seen:
        continue
    seen.add(dest)
    shutil.copy2(m["executable"], dest)
    print("staged", dest)
PY
rm -f "$json"
for ex in broadcast broadcast_weights; do
  cp "target/release/examples/$ex" ".gpu/bin/example-$ex"
done
# The Python package: the extension module next to its Python files, importable with
# PYTHONPATH=.gpu/py (abi3, so any CPython >= 3.10 there loads it), with its tests, example
# and bench.
cargo build --release -p gpucast-python --features extension-module
mkdir -p .gpu/py/gpucast
cp python/gpucast/*.py python/gpucast/*.pyi python/gpucast/py.typed .gpu/py/gpucast/
cp target/release/lib_native.so .gpu/py/gpucast/_native.abi3.so
cp -r python/tests .gpu/py/tests
mkdir -p .gpu/py/examples .gpu/py/bench
cp examples/python/*.py .gpu/py/examples/ 2>/dev/null || true
cp python/bench/*.py .gpu/py/bench/ 2>/dev/null || true
# pytest for the GPU machine, which has torch but no network.
python3 -m pip install --quiet --disable-pip-version-check --target .gpu/pylib pytest
find .gpu/py -name __pycache__ -prune -exec rm -rf {} +
strip .gpu/bin/* .gpu/py/gpucast/_native.abi3.so 2>/dev/null || true
cp ci/gpu-run.sh bench/benches/torch_broadcast.py .gpu/
# BASE=<commit>: also the benchmark of that commit, as .gpu/bin/base-bench, for `gpu-run.sh
# abab` (before and after, interleaved on one machine). Built from a worktree of its own
# into this target folder (its dependencies are shared; its own crates build apart, as their
# sources live elsewhere).
if [ -n "${BASE:-}" ]; then
  base_dir=$(mktemp -d /tmp/gpucast-base.XXXX)
  git worktree add --detach "$base_dir" "$BASE" >/dev/null
  root=$PWD
  exe=$(cd "$base_dir" && CARGO_TARGET_DIR="$root/target" cargo bench --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
exes = []
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"][0] == "bench":
        exes.append(m["executable"])
print(exes[0] if exes else "")')
  [ -n "$exe" ] || { echo "no benchmark built at $BASE" >&2; exit 1; }
  cp "$exe" .gpu/bin/base-bench && strip .gpu/bin/base-bench
  git rev-parse --short "$BASE" >.gpu/BASE
  git worktree remove --force "$base_dir"
fi
# The commit the binaries were built from (the GPU machine's copy of .git may be stale).
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!results' || echo -dirty)" >.gpu/COMMIT
du -sh .gpu
