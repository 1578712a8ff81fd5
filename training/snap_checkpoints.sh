#!/bin/bash
# copy each new ckpt_last.pt (written every ~10 min) of a train_g2p.py run to RUN_DIR/snap/, for --average:
#   training/snap_checkpoints.sh [RUN_DIR]      (default runs/g2p; run from the repository root)
cd "${1:-runs/g2p}" || exit 1
mkdir -p snap
last=""
while pgrep -f train_g2p.py > /dev/null; do
  if [ -f ckpt_last.pt ]; then
    m=$(stat -c %Y ckpt_last.pt)
    if [ "$m" != "$last" ]; then sleep 5; cp ckpt_last.pt "snap/ckpt_$m.pt"; last=$m; fi
  fi
  sleep 30
done
