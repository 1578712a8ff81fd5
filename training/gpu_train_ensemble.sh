#!/usr/bin/env bash
# The G2P ensemble in one command on the lent GPU: K teachers side by side, then students distilled from their
# ensemble, within BUDGET seconds in all (default 480); the weights and a tarball of the logs go to $OUT.
# Run from the repository root, with runs/g2p_data/ carried (training/g2p_pairs.py writes it):
#   bash training/gpu_train_ensemble.sh [BUDGET] [gpu_train.py options, e.g. --teachers 3]
# Writes to $OUT: teacher0..K-1.safetensors right after the teacher phase, student.safetensors at the end (float16,
# ~15 MB each at d_model 256), logs.tgz (run.json, curve.tsv, train.out, env.txt; rewritten at every milestone).
# Afterwards, on the CPU machine: .venv/bin/python training/finish_gpu_run.py FILES (training/README.md).
set -u
START=$(date +%s.%N)
BUDGET=${1:-480}
shift $(( $# > 0 ? 1 : 0 ))
OUT=${OUT:-runs/gpu_out}
WORK=runs/gpu_g2p_work
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  nproc
} > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"
[ -f runs/g2p_data/train.tsv ] || { echo "runs/g2p_data/train.tsv missing: carry runs/g2p_data" >&2; exit 2; }
# gpu_train.py stops itself 15 s before the budget; the timeout is the backstop (TERM: it saves and stops, KILL later)
timeout -s TERM -k 10 "$(( ${BUDGET%.*} - 5 ))" python3 training/gpu_train.py --budget "$BUDGET" --start "$START" \
  --out "$WORK" --weights-out "$OUT" "$@" > "$WORK/train.out" 2>&1
echo "gpu_train.py exit status $? after $(python3 -c "import time; print(round(time.time() - $START))")s" >> "$WORK/train.out"
tar -C "$WORK" --exclude='*.safetensors' --exclude='*.tmp' -czf "$OUT/logs.tgz" .
grep -E "steps/s|dev WER|kept|ensemble|wrote|graphs|no student|done|Error|error" "$WORK/train.out" | tail -40
ls -la "$OUT"
