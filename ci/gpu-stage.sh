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
strip .gpu/bin/* 2>/dev/null || true
cp ci/gpu-run.sh bench/benches/torch_broadcast.py .gpu/
du -sh .gpu
