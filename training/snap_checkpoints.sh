#!/bin/bash
# copy each new ckpt_last.pt (written every ~10 min and once more when the run stops) of a train_g2p.py run to
# RUN_DIR/snap/, for --average:
#   training/snap_checkpoints.sh [RUN_DIR]      (default runs/g2p; run from the repository root)
cd "${1:-runs/g2p}" || exit 1
mkdir -p snap
last=""
snap() {
  if [ -f ckpt_last.pt ]; then
    m=$(stat -c %Y ckpt_last.pt)
    if [ "$m" != "$last" ]; then sleep 5; cp ckpt_last.pt "snap/ckpt_$m.pt"; last=$m; fi
  fi
}
while pgrep -f train_g2p.py > /dev/null; do
  snap
  sleep 30
done
snap  # the checkpoint written at the stop, which the loop above no longer sees
