#!/usr/bin/env bash
# Training throughput on CUDA GPUs, for when one is at hand (the tests never need it): resnet50
# with --amp bf16 --channels-last, on synthetic data (--dummy: FakeData through the same uint8
# path), on a generated JPEG ImageFolder, decoded by the loader workers and with
# --decode-device cuda (nvJPEG in the training process, at most 8 workers: its ratio to --dummy,
# and the training process's CPU time spent decoding), and from batches preloaded in memory (the
# compute bound); then, under torchrun on the same JPEG set, --strategy fsdp and, with 2 or more GPUs, 2
# ranks with each --ddp-comm-hook and fsdp with and without --fsdp-offload (with one GPU: fsdp
# --fsdp-offload on 2 ranks sharing it over gloo). Prints samples/s for each, and the total
# time. On one H200 (torch 2.11): 320 s, the one-GPU branch included (it ended at its first
# checkpoint, below). With two or more GPUs about 8 minutes (estimated: each torchrun run adds
# about 30 s).
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
COMMON=(-a "$ARCH" --amp bf16 --lr 0.1 --device cuda)
FLAGS=("${COMMON[@]}" -b "$BATCH" -j "$WORKERS" --channels-last)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# The last epoch's samples/s (all ranks) and data wait, from a run's metrics.jsonl: NAME FILE.
result() {
    "$PY" -c "
import json, sys
train = [r for r in map(json.loads, open(sys.argv[2])) if r['split'] == 'train']
print(f\"RESULT {sys.argv[1]}: {train[-1]['samples_per_sec']:.0f} samples/s, data wait {100 * train[-1]['data_wait']:.0f}%\")
" "$1" "$2"
}

# 1. --dummy: an epoch is ImageNet's size, so it runs for a fixed time; the rate is taken
# between the last two progress lines (each prints the epoch's running samples/s).
echo "== $ARCH, --dummy (FakeData, ${WORKERS} workers), 120 s"
timeout 120 "$PY" -m ddptrain train --dummy "${FLAGS[@]}" --epochs 1 -p 20 \
    --out-dir "$OUT/dummy" | tee "$OUT/dummy.log" || true
"$PY" - "$OUT/dummy.log" "$BATCH" <<'PY'
import re, sys
rows = [(int(m[1]), float(m[2])) for m in re.finditer(r"\[\s*(\d+)/\d+\].*?\|\s*([\d.]+) samples/s", open(sys.argv[1]).read())]
if len(rows) < 2:
    sys.exit("dummy: fewer than two progress lines")
(s1, r1), (s2, r2) = rows[-2:]
b = int(sys.argv[2])
rate = b * (s2 - s1) / (b * s2 / r2 - b * s1 / r1)
print(f"RESULT dummy: {rate:.0f} samples/s (steps {s1}-{s2})")
open(sys.argv[1] + ".rate", "w").write(str(rate))
PY

# 2. A generated JPEG ImageFolder (500x375, ImageNet-like density): 3 epochs, the last counts.
echo "== $ARCH, generated JPEG set"
DATA=$("$PY" -c "
import os
from bench import common
s = common.Scale(train_per_class=1280, val_per_class=32)
print(common.jpeg_folder(s, processes=os.cpu_count()))")
"$PY" -m ddptrain train "$DATA" "${FLAGS[@]}" --epochs 3 -p 5 --out-dir "$OUT/jpeg"
result jpeg "$OUT/jpeg/metrics.jsonl"

# 2'. The same set with --decode-device cuda and at most 8 workers (they only read bytes): the
# run's start line says which library decoded; the ratio is to --dummy's rate (the goal: 0.9).
# Then the loader alone for an epoch (bench.gpu_decode): the CPU time the training process
# spent decoding and transforming, per 1000 images.
GPU_WORKERS=$(( WORKERS < 8 ? WORKERS : 8 ))
echo "== $ARCH, generated JPEG set, --decode-device cuda (${GPU_WORKERS} workers)"
"$PY" -m ddptrain train "$DATA" "${COMMON[@]}" -b "$BATCH" -j "$GPU_WORKERS" --channels-last \
    --decode-device cuda --epochs 3 -p 5 --out-dir "$OUT/gpu-decode" 2>&1 | tee "$OUT/gpu-decode.log"
grep -o "decode-device cuda: .*" "$OUT/gpu-decode.log" | head -n 1 | sed 's/^/RESULT decoder: /' || true
result gpu-decode "$OUT/gpu-decode/metrics.jsonl"
"$PY" -c "
import json, sys
train = [r for r in map(json.loads, open(sys.argv[1])) if r['split'] == 'train']
ratio = train[-1]['samples_per_sec'] / float(open(sys.argv[2]).read())
print(f'RESULT gpu-decode / dummy: {ratio:.2f} (goal >= 0.9: {\"met\" if ratio >= 0.9 else \"NOT met\"})')
" "$OUT/gpu-decode/metrics.jsonl" "$OUT/dummy.log.rate"
"$PY" -m bench.gpu_decode "$DATA" -b "$BATCH" -j "$GPU_WORKERS" | tail -n 1 | sed 's/^/RESULT gpu-decode loader alone: /'

# 3. The same loop fed from memory: the compute bound of the JPEG run.
echo "== $ARCH, compute bound (batches preloaded)"
"$PY" -m bench.bound "$DATA" -a "$ARCH" -b "$BATCH" -j "$WORKERS" --amp bf16 --lr 0.1 \
    --epochs 3 --device cuda | tail -n 1 | "$PY" -c "
import json, sys
print(f\"RESULT bound: {json.loads(sys.stdin.read())['samples_per_sec'][-1]:.0f} samples/s\")"

# 4 and 5: `ddptrain train` on the JPEG set under torchrun (python -m torch.distributed.run),
# 3 epochs, the last counts: NAME PROCESSES FLAG... A run that fails or passes 100 s is
# reported as FAILED and the others go on; the script then exits 1.
FAILED=0
torchrun_check() {
    local name=$1 procs=$2
    shift 2
    echo "== $ARCH, $name (torchrun --nproc-per-node $procs)"
    if timeout 100 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$procs" \
        -m ddptrain train "$DATA" "$@" --epochs 3 -p 5 --out-dir "$OUT/$name"; then
        result "$name" "$OUT/$name/metrics.jsonl"
    else
        echo "RESULT $name: FAILED (exit $?)"
        FAILED=1
    fi
}

# 4. --strategy fsdp on the one GPU a single process gets. With one process fsdp trains the
# plain model (nothing to shard): this times that path, channels_last by default as under ddp
# (with several ranks, the batches alone: the shards stay contiguous, as FSDP2 shards them).
torchrun_check fsdp-1 1 "${COMMON[@]}" -b "$BATCH" -j "$WORKERS" --strategy fsdp

# 5. Two ranks, one GPU each, 256 images per GPU (-b is global): plain DDP, each comm hook, and
# multi-GPU fsdp. NCCL puts one rank per GPU, so this needs 2 GPUs and is skipped with fewer.
# The count is torch's: `nvidia-smi -L | wc -l` would also count the lines of MIG instances
# and ignore CUDA_VISIBLE_DEVICES. PowerSGD compresses from its third step (of 30) on.
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 2 ]; then
    echo "== skipped: NCCL on 2 ranks (ddp, --ddp-comm-hook bf16|fp16|powersgd, fsdp) needs 2 GPUs; $GPUS here"
    # 5'. One GPU: 2 ranks share it over gloo (NCCL refuses two ranks on one device), each
    # started on its own with --dist-url tcp:// (rank modulo the node's one device: cuda:0 for
    # both). Its samples/s mean little: it runs --fsdp-offload's path that the CPU tests
    # cannot reach (rank 1 builds on the meta device, shards in pinned host memory, buffers on
    # the GPU) and its resume, on the real CLI: resnet18 for an epoch, then resumed for a
    # second. With torch 2.11 both ranks trained, then crashed (SIGSEGV) in torch's
    # full-state-dict gather (DTensor's all-gather of CUDA tensors over gloo) at the first
    # checkpoint.
    two_on_one() {  # EPOCHS FLAG...
        local epochs=$1 port pids=() rank status=0
        shift
        port=$("$PY" -c "from ddptrain.distributed.ports import free_port; print(free_port())")
        for rank in 0 1; do
            # -k: a rank stuck in a collective may not heed SIGTERM (--dist-timeout is 600 s)
            timeout -k 15 150 "$PY" -m ddptrain train "$DATA" -a resnet18 --amp bf16 --device cuda \
                -b 256 -j 4 --strategy fsdp --fsdp-offload --dist-backend gloo \
                --dist-url "tcp://127.0.0.1:$port" --world-size 2 --rank "$rank" \
                --epochs "$epochs" -p 5 --out-dir "$OUT/offload" "$@" >"$OUT/offload.$rank.log" 2>&1 &
            pids+=($!)
        done
        for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
        tail -n 4 "$OUT"/offload.*.log
        return "$status"
    }
    echo "== resnet18, fsdp --fsdp-offload on 2 ranks sharing the GPU over gloo, then resumed"
    if two_on_one 1 && two_on_one 2 --resume auto && grep -q "resumed from" "$OUT/offload.0.log"; then
        result fsdp-offload-2-on-1 "$OUT/offload/metrics.jsonl"
        echo "RESULT fsdp-offload-2-on-1 resume: ok"
    else
        echo "RESULT fsdp-offload-2-on-1: FAILED"
        FAILED=1
    fi
else
    TWO=("${COMMON[@]}" -b $(( 2 * BATCH )) -j $(( WORKERS / 2 > 0 ? WORKERS / 2 : 1 )))
    torchrun_check ddp-2 2 "${TWO[@]}" --channels-last
    for hook in bf16 fp16; do
        torchrun_check "ddp-2-$hook" 2 "${TWO[@]}" --channels-last --ddp-comm-hook "$hook"
    done
    torchrun_check ddp-2-powersgd 2 "${TWO[@]}" --channels-last --ddp-comm-hook powersgd \
        --powersgd-start-step 2
    torchrun_check fsdp-2 2 "${TWO[@]}" --strategy fsdp
    # Rank 1 builds on the meta device and its shards live in pinned host memory, its buffers
    # on the GPU: the one path of the meta build the CPU tests cannot reach.
    torchrun_check fsdp-2-offload 2 "${TWO[@]}" --strategy fsdp --fsdp-offload
    # Its resume: torch's full state dict load refuses a model on two devices, which
    # checkpointer.py works around by moving the buffers beside the shards for the load.
    if [ -f "$OUT/fsdp-2-offload/checkpoint.pt" ]; then
        echo "== $ARCH, fsdp-2-offload resumed for a 4th epoch"
        if timeout 100 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
            -m ddptrain train "$DATA" "${TWO[@]}" --strategy fsdp --fsdp-offload --epochs 4 \
            -p 5 --resume auto --out-dir "$OUT/fsdp-2-offload" | tee "$OUT/resume.log" &&
            grep -q "resumed from" "$OUT/resume.log"; then
            echo "RESULT fsdp-2-offload resume: ok"
        else
            echo "RESULT fsdp-2-offload resume: FAILED"
            FAILED=1
        fi
    fi
fi
echo "== done in $SECONDS s"
exit "$FAILED"
