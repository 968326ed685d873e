#!/usr/bin/env bash
# Sets up (tools/setup.sh) and runs the test suite on the Vulkan device the loader finds
# (lavapipe here) with the Khronos validation layer on: any validation message fails a test.
# Extra arguments go to pytest.  Usage: bash tools/test.sh [-k PATTERN]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash tools/setup.sh --tests
export VKXSPLIT_VALIDATION=${VKXSPLIT_VALIDATION:-1}
export VKXSPLIT_CACHE_DIR=${VKXSPLIT_CACHE_DIR:-$root/.venv/cache}
.venv/bin/ruff check vkxsplit tests tools native
# the experiment kernels some tests use (tools/kernels.py), built here rather than inside the
# first test that asks for them (a cold build takes minutes on 2 cores; fresh ones are skipped)
.venv/bin/python tools/build_tool_shaders.py
exec .venv/bin/python -m pytest -q -ra "$@"
