#!/bin/bash
# Re-derive every figure the docs quote from the embedded model's weights, after new weights were copied into
# src/beamsearch/models/g2p_cmudict/ (training/README.md, "Shipping new weights"). Run from the repository root:
#
#     bash training/rederive.sh [OUT_DIR]      # default runs/rederive; one thread each, about 6 minutes here
#
# Writes OUT_DIR/*.md (the eval tables), OUT_DIR/make_run.txt (the README's block), docs/search_errors.png, and
# prints the agreement counts between the native, lean and int8 steps on the 2,000 test words.
set -euo pipefail
B=.venv/bin/beamsearch
OUT=${1:-runs/rederive}
DEV=src/beamsearch/data/cmudict/dev.tsv
mkdir -p "$OUT"
run() { echo "+ $*" >&2; "$@"; }
run $B eval --threads 1 --beams 1 5 > "$OUT/test_fp32.md"
run $B eval --threads 1 --beams 1 5 --data $DEV > "$OUT/dev_fp32.md"
run $B eval --threads 1 --beams 1 5 --int8 > "$OUT/test_int8.md"
BEAMSEARCH_NATIVE=0 run $B eval --threads 1 --beams 1 5 --int8 > "$OUT/test_int8_eager.md"
run $B eval --threads 1 --beams 1 5 --int8 --lean-step > "$OUT/test_int8_lean.md"
run make run > "$OUT/make_run.txt"
cut -f1 src/beamsearch/data/cmudict/test.tsv > "$OUT/words.txt"
for beams in 1 5; do
  run $B decode "$OUT/words.txt" --num-beams $beams --threads 1 > "$OUT/native_$beams.txt"
  run $B decode "$OUT/words.txt" --num-beams $beams --threads 1 --lean-step > "$OUT/lean_$beams.txt"
  run $B decode "$OUT/words.txt" --num-beams $beams --threads 1 --int8 > "$OUT/int8_$beams.txt"
  BEAMSEARCH_NATIVE=0 run $B decode "$OUT/words.txt" --num-beams $beams --threads 1 --int8 > "$OUT/int8eager_$beams.txt"
done
run $B eval --search-errors --plot docs/search_errors.png --threads 1 > "$OUT/search_errors.md"
same() { awk 'NR == FNR { line[FNR] = $0; next } line[FNR] == $0' "$1" "$2" | wc -l; }  # whole lines (they hold tabs)
for beams in 1 5; do
  echo "beams $beams, words whose best output equals the float32 lean step's (of 2000):" \
    "native $(same "$OUT/native_$beams.txt" "$OUT/lean_$beams.txt")," \
    "native int8 $(same "$OUT/int8_$beams.txt" "$OUT/lean_$beams.txt")," \
    "eager int8 $(same "$OUT/int8eager_$beams.txt" "$OUT/lean_$beams.txt")"
done
grep -H -E "^\| (greedy|beam)" "$OUT"/*.md || true
