#!/usr/bin/env bash
# The G2P ensemble in one command on the lent GPU: K teachers side by side, then students distilled from their
# ensemble, within BUDGET seconds in all (default 480); the weights and a tarball of the logs go to $OUT.
# Run from the repository root, with runs/g2p_data/ carried (training/g2p_pairs.py writes it):
#   bash training/gpu_train_ensemble.sh [BUDGET] [gpu_train.py options, e.g. --teachers 3]
# The two phases are two processes (gpu_train.py --phase teachers, then --phase students), so that nothing one leaves
# behind in CUDA (a failed graph capture, a poisoned context) can reach the other. A phase that dies without its
# weights is run once more without CUDA graphs, if time is left.
# Writes to $OUT (the device returns at most 8 files, 16 MiB each, 64 MiB in all): the best 3 of the 4 teachers
# (teacher{k}.safetensors) right after the teacher phase, student.safetensors at the end (float16, 14.8 MB each at
# d_model 256), logs.tgz (run.json, curve.tsv, train.out, env.txt; rewritten at every milestone): 5 files, ~59 MB.
# Afterwards, on the CPU machine: .venv/bin/python training/finish_gpu_run.py FILES (training/README.md).
set -u
START=$(date +%s.%N)
BUDGET=${1:-480}
shift $(( $# > 0 ? 1 : 0 ))
OUT=${OUT:-runs/gpu_out}
WORK=runs/gpu_g2p_work
rm -rf "$WORK"  # a fresh run: the student phase must not find an older run's teachers
mkdir -p "$OUT" "$WORK"
rm -f "$OUT"/teacher*.safetensors "$OUT"/student.safetensors "$OUT"/logs.tgz
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  nproc
} > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"
[ -f runs/g2p_data/train.tsv ] || { echo "runs/g2p_data/train.tsv missing: carry runs/g2p_data" >&2; exit 2; }

left() { python3 -c "import time; print(int($START + ${BUDGET%.*} - time.time()))"; }

# phase PHASE [options]: one gpu_train.py process; it stops itself 15 s before the budget (--reserve), the timeout is
# the backstop (TERM: it chooses, saves and stops; KILL 10 s later). Its exit status is left in $STATUS.
phase() {
  local name=$1
  shift
  timeout -s TERM -k 10 "$(( $(left) - 5 ))" python3 training/gpu_train.py --phase "$name" --budget "$BUDGET" \
    --start "$START" --out "$WORK" --weights-out "$OUT" "$@" >> "$WORK/train.out" 2>&1
  STATUS=$?
  echo "gpu_train.py --phase $name $*: exit status $STATUS, $(left)s left" >> "$WORK/train.out"
}
crashed() { [ "$STATUS" -ne 0 ] && [ "$STATUS" -ne 124 ] && [ "$STATUS" -ne 137 ] && [ "$(left)" -gt 90 ]; }

phase teachers "$@"
if [ ! -f "$WORK/teachers.safetensors" ] && crashed; then
  phase teachers "$@" --graphs off
fi
if [ -f "$WORK/teachers.safetensors" ]; then
  phase students "$@"
  if [ ! -f "$OUT/student.safetensors" ] && crashed; then
    phase students "$@" --graphs off
  fi
fi
tar -C "$WORK" --exclude='*.safetensors' --exclude='*.tmp' -czf "$OUT/logs.tgz" .
grep -E "steps/s|dev WER|kept|ensemble|wrote|graphs|no student|done|exit status|Error|error" "$WORK/train.out" | tail -50
ls -la "$OUT"
