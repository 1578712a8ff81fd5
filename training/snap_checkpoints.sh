#!/bin/bash
# copy each new ckpt_last.pt (written every ~10 min) for checkpoint averaging
cd /work/main/runs/g2p
last=""
while pgrep -f train_g2p.py > /dev/null; do
  if [ -f ckpt_last.pt ]; then
    m=$(stat -c %Y ckpt_last.pt)
    if [ "$m" != "$last" ]; then sleep 5; cp ckpt_last.pt snap/ckpt_$m.pt; last=$m; fi
  fi
  sleep 30
done
