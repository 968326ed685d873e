#!/usr/bin/env bash
# Sets up (tools/setup.sh) and runs vkxsplit's main job: text generation with the default
# model (SmolLM2-135M-Instruct Q4_1, offline). Arguments go to `vkxsplit run`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash tools/setup.sh
exec .venv/bin/vkxsplit run "$@"
