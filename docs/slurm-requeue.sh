#!/bin/bash
# Train on SLURM through preemption and time limits: 120 s before the limit SLURM sends USR1 to
# this script, which stops the training (every rank saves at one step and exits 0; torchrun
# gives the ranks 30 s for it), then requeues the job, which resumes (--resume auto).
#   sbatch docs/slurm-requeue.sh /data/imagenet -a resnet50 -b 2048 --out-dir runs/r50
#SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=8
#SBATCH --requeue --signal=B:USR1@120 --open-mode=append
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# srun itself takes a SIGTERM as "kill the step now": signal the step's processes instead.
trap 'scancel --signal TERM "$SLURM_JOB_ID"; wait $pid; scontrol requeue "$SLURM_JOB_ID"' USR1
# A restarted torchrun group must not read the dead attempt's addresses (docs/faults.md).
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 srun torchrun --nnodes "$SLURM_NNODES" \
    --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d \
    --rdzv-endpoint "$head:29400" --rdzv-id "$SLURM_JOB_ID" \
    -m ddptrain train "$@" --checkpoint-every 1000 --resume auto &
pid=$!
wait $pid
