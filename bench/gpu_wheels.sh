#!/usr/bin/env bash
# Wheels for a GPU machine without internet whose image already has JAX (with its CUDA plugin),
# flax, optax, orbax-checkpoint, tensorboard, numpy, sentencepiece, tokenizers, safetensors and
# pyarrow, but not the rest of tunix_train's dependencies (and tokamax's, model.moe_matmul=tokamax). Run it where pip can download (any
# processor), from the repository root:
#   bash bench/gpu_wheels.sh            # writes .whl/ (ignored by git), ~8 MB, Python 3.12 x86-64
# bench/gpu_check.sh installs them from there (pip --no-index --target /tmp/site) when it finds
# that hydra, grain or qwix cannot be imported. The versions are constraints.txt's.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
pin() { grep -i "^$1==" constraints.txt; }
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64; do platforms+=(--platform "$p"); done
for name in hydra-core omegaconf grain array_record qwix tensorboardX portpicker \
            tokamax einshape immutabledict jaxtyping wadler_lindig typeguard pydantic \
            pydantic_core annotated-types typing-inspection; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$(pin "$name")"
done
# Hydra's parser runtime is published as a source archive only (pure Python): built here.
python3 -m pip wheel --quiet --no-deps -w .whl "$(pin antlr4-python3-runtime)"
ls .whl
