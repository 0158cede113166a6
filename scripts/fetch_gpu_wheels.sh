#!/usr/bin/env bash
# The packages the server, the structured outputs and the bench client need on the GPU
# machine, which has torch, triton and transformers but not these: wheels for CPython 3.12
# on manylinux x86_64, with their dependencies, into DIR (default .whl, git-ignored).
#
#   bash scripts/fetch_gpu_wheels.sh [DIR]
#
# There, before the commands:
#   python3 -m pip install -q --no-index --no-deps --target SITE .whl/*.whl
#   export PYTHONPATH=SITE:. PATH=SITE/bin:$PATH     (SITE: any scratch directory)
# uvloop comes with uvicorn[standard], as in a user's install: without it the server runs
# on asyncio's pure-Python loop, and its HTTP figures are not the users'.
set -euo pipefail
dir=${1:-.whl}
python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$dir" \
    fastapi "uvicorn[standard]" pydantic pyzmq prometheus-client llguidance \
    partial-json-parser jsonschema aiohttp py-spy
