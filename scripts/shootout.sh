#!/usr/bin/env bash
# The drafter shoot-out: every drafter trained on the same target with the same data and the same
# number of target tokens (same preset, steps and batch), then benched on MT-bench / HumanEval / GSM8K,
# chain and tree. Resumable: a finished training or bench is skipped.
#   bash scripts/shootout.sh [drafter ...]       (default: all of them, on SmolLM2-135M)
#   TARGET=gemma PRESET=default STEPS=20 EXTRA="data.max_length=256" bash scripts/shootout.sh mtp gemma_mtp
# then: python scripts/shootout_table.py $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/shootout}
TARGET=${TARGET:-llama}
PRESET=${PRESET:-full}       # trainer preset: full = self-distilled data (regenerated once per target, cached)
STEPS=${STEPS:-100}          # optimizer steps of batch 4 x <=512 tokens (no time budget: the same for every drafter)
EXTRA=${EXTRA:-}             # more training overrides, the same for every drafter
N=${N:-5}                    # prompts per set
TOKENS=${TOKENS:-96}         # new tokens per prompt
CHAIN=${CHAIN:-4}            # drafts per target forward (chain)
TREE=${TREE:-"depth=4 topk=4 total_tokens=12"}
PHASES=${PHASES:-"train bench"}  # PHASES=train: train only (bench later, on a quiet machine)
DRAFTERS=("$@")
[ ${#DRAFTERS[@]} -gt 0 ] || DRAFTERS=(eagle3 eagle medusa mtp gemma_mtp dflash dspark)
for drafter in "${DRAFTERS[@]}"; do
  run="$OUT/$TARGET/$drafter"
  if [ ! -f "$run/train.done" ] && [[ $PHASES == *train* ]]; then
    mkdir -p "$run"
    start=$(date +%s)
    python -m training.run drafter="$drafter" target="$TARGET" trainer="$PRESET" trainer.max_steps="$STEPS" trainer.max_minutes=null \
      logger=none hydra.run.dir="$run" $EXTRA 2>&1 | tee "$run/train.log"
    echo $(( $(date +%s) - start )) > "$run/train.done"
  fi
  [[ $PHASES == *bench* ]] || continue
  bench="python -m serving.bench artifact=$run/checkpoints/latest prompts=[mtbench,humaneval,gsm8k] n=$N max_new_tokens=$TOKENS"
  [ -f "$run/chain.json" ] || $bench draft=chain steps="$CHAIN" out="$run/chain.json"
  [ "$drafter" = dspark ] || [ -f "$run/tree.json" ] || $bench draft=tree $TREE out="$run/tree.json"  # DSpark: chains only
done
