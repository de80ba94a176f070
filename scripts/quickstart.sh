#!/usr/bin/env bash
# Set everything up, then train the default EAGLE-3 head on the embedded SmolLM2-135M target.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m training.run drafter=eagle3 target=llama "$@"
