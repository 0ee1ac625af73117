#!/usr/bin/env bash
# Prepares .whl/ (git-ignored) for the device tool's GPU machine, which has torch, triton and
# transformers but not the rest of pagecast's dependencies, nor pytest, nor the test tokenizer:
# the wheels it lacks (CPython 3.12, x86-64), the SmolLM2 tokenizer files the tiny test models use,
# and .whl/setup.sh, which a device command sources first:
#
#     bash benchmarks/device_wheels.sh                      # here, once a checkout
#     run: source .whl/setup.sh && python3 benchmarks/gpu_queue.py --out $OUT     (carry: [".whl"])
#
# setup.sh installs the wheels into /tmp/site and lays out pagecast's packages (pyproject's
# package-dir) as symlinks under /tmp/pc, so `import pagecast` works from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl/tokenizer
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    pytest pluggy iniconfig pygments packaging pytest-timeout click starlette anyio sniffio uvicorn h11 pydantic pydantic-core \
    annotated-types typing-inspection typing_extensions prometheus-client rich markdown-it-py mdurl pyzmq \
    msgspec xgrammar apache-tvm-ffi
tokenizer=$(.venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); from tiny_models import smollm2_dir; print(smollm2_dir())")
for f in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
    if [ -f "$tokenizer/$f" ]; then cp "$tokenizer/$f" .whl/tokenizer/; fi
done
cat > .whl/setup.sh <<'SETUP'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
mkdir -p /tmp/pc/pagecast
for d in builder kernels runtime templates; do ln -sfn "$PWD/$d" "/tmp/pc/pagecast/$d"; done
touch /tmp/pc/pagecast/__init__.py
export PYTHONPATH=/tmp/pc:/tmp/site
export PAGECAST_TEST_TOKENIZER_DIR="$PWD/.whl/tokenizer"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
SETUP
du -sh .whl
