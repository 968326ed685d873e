#!/usr/bin/env bash
# Sets up (tools/setup.sh) and runs vkxsplit's main job: text generation with the default
# model (SmolLM2-135M-Instruct Q4_1, offline). Arguments go to `vkxsplit run`.
# The set-up's own output goes to build/setup.log and is shown only if it fails, so what this
# prints is the answer and its timing line.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
mkdir -p build
if ! bash tools/setup.sh >build/setup.log 2>&1; then
  cat build/setup.log >&2
  echo "run.sh: the set-up failed (its output above, also in build/setup.log)" >&2
  exit 1
fi
exec .venv/bin/vkxsplit run "$@"
