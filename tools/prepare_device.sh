#!/usr/bin/env bash
# Prepares .device/ (git-ignored) for the lent GPU machine: the shared set-up
# (../shared/gpu/prepare.sh: the Vulkan loader, wheels the machine lacks, llama.cpp's Vulkan
# llama-server as the benchmarks' peer) plus what vkxsplit's own runs there need: the
# libggml-python wheel (the cpu backend: without it the tests that attach `cpu` fail there) and
# Debian's Khronos validation layer (VKXSPLIT_VALIDATION=1; tools/device_common.sh points
# VK_LAYER_PATH at it). Then every device call carries [".device"] and sources
# tools/device_common.sh (or .device/on-device.sh).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
WITH_PEER=${WITH_PEER:-1} bash ../shared/gpu/prepare.sh "libggml-python==$(.venv/bin/python -c \
  'from importlib.metadata import version; print(version("libggml-python"))' 2>/dev/null || echo 0.20.2.post1)"
if ! ls .device/gl/vulkan-validationlayers_*.deb >/dev/null 2>&1; then
  o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  (cd .device/gl && apt-get $o download vulkan-validationlayers)
fi
du -sh .device
