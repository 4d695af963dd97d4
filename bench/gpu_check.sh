#!/usr/bin/env bash
# Training throughput on one CUDA GPU, for when one is at hand (the tests never need it):
# resnet50 with --amp bf16 --channels-last, on synthetic data (--dummy: FakeData through the
# same uint8 path), on a generated JPEG ImageFolder, and from batches preloaded in memory (the
# compute bound). Prints samples/s for each. About 5 minutes with the venv in place.
#
#   bash bench/gpu_check.sh            (from the repository root; PYTHON=... to pick python)
set -euo pipefail
cd "$(dirname "$0")/.."

# A python with torch and torchvision: .venv, else $PYTHON/python3, else make creates .venv.
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
    PY=.venv/bin/python
elif "${PYTHON:-python3}" -c "import torch, torchvision" 2>/dev/null; then
    PY="${PYTHON:-python3}"
else
    make .venv/.installed
    PY=.venv/bin/python
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"

ARCH=resnet50 BATCH=256 WORKERS=$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))
FLAGS=(-a "$ARCH" -b "$BATCH" -j "$WORKERS" --amp bf16 --channels-last --lr 0.1 --device cuda)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# 1. --dummy: an epoch is ImageNet's size, so it runs for a fixed time; the rate is taken
# between the last two progress lines (each prints the epoch's running samples/s).
echo "== $ARCH, --dummy (FakeData, ${WORKERS} workers), 150 s"
timeout 150 "$PY" -m ddptrain train --dummy "${FLAGS[@]}" --epochs 1 -p 20 \
    --out-dir "$OUT/dummy" | tee "$OUT/dummy.log" || true
"$PY" - "$OUT/dummy.log" "$BATCH" <<'PY'
import re, sys
rows = [(int(m[1]), float(m[2])) for m in re.finditer(r"\[\s*(\d+)/\d+\].*?\|\s*([\d.]+) samples/s", open(sys.argv[1]).read())]
if len(rows) < 2:
    sys.exit("dummy: fewer than two progress lines")
(s1, r1), (s2, r2) = rows[-2:]
b = int(sys.argv[2])
print(f"RESULT dummy: {b * (s2 - s1) / (b * s2 / r2 - b * s1 / r1):.0f} samples/s (steps {s1}-{s2})")
PY

# 2. A generated JPEG ImageFolder (500x375, ImageNet-like density): 3 epochs, the last counts.
echo "== $ARCH, generated JPEG set"
DATA=$("$PY" -c "
import os
from bench import common
s = common.Scale(train_per_class=1280, val_per_class=32)
print(common.jpeg_folder(s, processes=os.cpu_count()))")
"$PY" -m ddptrain train "$DATA" "${FLAGS[@]}" --epochs 3 -p 5 --out-dir "$OUT/jpeg"
"$PY" -c "
import json, sys
train = [r for r in map(json.loads, open(sys.argv[1])) if r['split'] == 'train']
print(f\"RESULT jpeg: {train[-1]['samples_per_sec']:.0f} samples/s, data wait {100 * train[-1]['data_wait']:.0f}%\")
" "$OUT/jpeg/metrics.jsonl"

# 3. The same loop fed from memory: the compute bound of the JPEG run.
echo "== $ARCH, compute bound (batches preloaded)"
"$PY" -m bench.bound "$DATA" -a "$ARCH" -b "$BATCH" -j "$WORKERS" --amp bf16 --lr 0.1 \
    --epochs 3 --device cuda | tail -n 1 | "$PY" -c "
import json, sys
print(f\"RESULT bound: {json.loads(sys.stdin.read())['samples_per_sec'][-1]:.0f} samples/s\")"
