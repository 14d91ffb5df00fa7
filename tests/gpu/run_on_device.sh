#!/usr/bin/env bash
# Run the GPU tests on a machine with CUDA and a system torch, with no project install: the few packages the
# trainer needs beyond torch/transformers come as wheels in .whl/, and the repo's directories are mapped to the
# sluiceway.* package by symlinks. Fetch the wheels where pip has a network (Python 3.12, x86-64):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform any -d .whl megatron-core==0.16.1 pydantic pydantic-core \
#       annotated-types typing-inspection zstandard
# (pydantic-core at the version your pydantic asks for). .whl/ is git-ignored. No other wheel: the GPU paths'
# torch.compile (models/fused_logprobs.py, megatron's SwiGLU) uses the Triton that CUDA builds of torch ship with,
# and runs eagerly where compiling fails. On a machine with the project installed, plain `pytest tests/gpu` does
# the same.
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=${SITE:-/tmp/sluiceway-site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
mkdir -p "$SITE/sluiceway"
for d in flows tasks storage models infra; do ln -sfn "$PWD/$d" "$SITE/sluiceway/$d"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', m.__version__)"
# --noconftest: tests/conftest.py starts S3 servers the GPU tests do not use (and needs packages not here).
python3 -m pytest -q --noconftest -p no:cacheprovider tests/gpu "$@"
