#!/bin/bash
# Device-machine wrapper for tools/recipe_sweep.py: runs the sweep under /tmp and brings back the
# table, the logs and the exports of the best variants (the device tool returns at most 8 files).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.used --format=csv
python3 tools/recipe_sweep.py --out /tmp/sweep --device cuda --rows-file $OUT/rows.jsonl "$@" 2>&1 | tee $OUT/sweep.txt
cp /tmp/sweep/results.json $OUT/ 2>/dev/null
for f in /tmp/sweep/*.log; do echo "== $f"; tr "\r" "\n" < $f | grep -v "step/s\|chunk/s" | tail -n 5; done > $OUT/logs.txt 2>&1
python3 - <<'PY'
import json, os, tarfile
rows = json.load(open("/tmp/sweep/results.json"))
best = {}
for r in rows:
    best[r["variant"]] = max(best.get(r["variant"], 0), r["accuracy"])
top = sorted(best, key=best.get, reverse=True)[:3]
top += [v for v in os.environ.get("KEEP", "").split(",") if v and v in best and v not in top]
with tarfile.open(os.environ["OUT"] + "/top_exports.tar", "w") as tar:
    for name in top:
        for f in ("config.json", "model.safetensors"):
            tar.add(f"/tmp/sweep/{name}/export/{f}", f"{name}/{f}")
print("exports of", top)
PY
