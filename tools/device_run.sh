#!/usr/bin/env bash
# Runs on the lent NVIDIA machine (device tool), from the repo root (or from .snap/, made by
# tools/device_snapshot.sh, to run exactly what is committed), after
# `bash ../shared/gpu/prepare.sh` here and with carry [".device"]:
#   bash tools/device_run.sh [warm] [tests] [kernels] [models] [handoff] [planner] [info] [matvec] [coopmat] [coop-chosen] [ab] [mulmat-tests] [cm2-tests] [cm2] [cm2-chosen] [multigpu] [hub-tests] [cuda-tests] [save-cache]
# (env: MODELS_ARGS for tools/bench_models.py, KERNELS_ARGS for tools/bench_kernels.py, MATVEC_ARGS, COOPMAT_ARGS, AB_ARGS, LINK_ARGS, CM2_ARGS, WARM_ARGS,
#  TESTS_ARGS: the pytest selection of `tests` (default: tests), TESTS_TIMEOUT (default 540 s))
# The validation layer for the test targets: apt-get download vulkan-validationlayers into .device/gl
# (on-device.sh unpacks every .deb there; without it VKXSPLIT_VALIDATION=1 tests error at set-up).
# Put `warm` before the test targets on a fresh machine (tools/warm_pipelines.py says why).
# Experiment kernels (benchmark sweeps, probes, flag waits, emulated and decode-check kernels:
# tools/kernels.py) do not ship and the GPU machine has no compiler: build them here first,
#   python tools/build_tool_shaders.py          # -> build/tool-spv (git-ignored; --check says what is stale)
# and carry them with the rest: carry [".device", "build/tool-spv"]. Without them the benchmarks
# time only the shipped kernels and the tests that need one skip.
# Target save-cache writes the pipeline caches (ours and the driver's) to $OUT/pcache.tgz; carry
# that file back as .pcache.tgz and the next (fresh) machine starts warm: it is unpacked here.
# Results go to $OUT (tests.log, bench_kernels.md, bench_models.md, info.txt, info.json).
set -uo pipefail
. .device/on-device.sh || exit 1
export VK_LAYER_PATH=/usr/share/vulkan/explicit_layer.d
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${*:-tests kernels models handoff info}
# native helpers: build in place (gcc + cffi are there); tests skip what needs them otherwise
python3 native/build_native.py >/dev/null 2>&1 || echo "native build failed (tests needing it skip)"
if [[ -f .pcache.tgz ]]; then tar -C / -xzf .pcache.tgz && echo "pipeline caches unpacked from .pcache.tgz"; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# say which experiment kernels are missing or stale (their tests skip, their sweeps shrink)
python3 tools/build_tool_shaders.py --check 2>&1 | tail -n 4 | sed 's/^/experiment kernels: /'
for w in $what; do
  case $w in
    warm)
      # every usable pipeline into the cache the test targets read (env WARM_ARGS, e.g.
      # --prefix mul_mat_cm2_): a cold machine compiles them far faster without the validation layer
      VKXSPLIT_CACHE_DIR=/tmp/vkxcache timeout 240 python3 tools/warm_pipelines.py ${WARM_ARGS:-} 2>&1 | tail -12 ;;
    tests)
      VKXSPLIT_VALIDATION=1 VKXSPLIT_CACHE_DIR=/tmp/vkxcache timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -ra -p no:cacheprovider \
        --durations=12 -o addopts="" ${TESTS_ARGS:-tests} 2>&1 | tee "$OUT/tests.log" | tail -60 ;;
    save-cache)
      tar -C / -czf "$OUT/pcache.tgz" tmp/vkxcache $(cd / && ls -d root/.cache/nvidia 2>/dev/null) 2>/dev/null
      ls -la "$OUT/pcache.tgz" ;;
    kernels)
      timeout ${KERNELS_TIMEOUT:-480} python3 tools/bench_kernels.py ${KERNELS_ARGS:-} 2>&1 | tee "$OUT/bench_kernels.md" ;;
    models)
      timeout 420 python3 tools/bench_models.py ${MODELS_ARGS:-} 2>&1 | tee "$OUT/bench_models.md" ;;
    handoff)
      timeout 200 python3 tools/bench_handoff.py 2>&1 | tee "$OUT/bench_handoff.md" ;;
    planner)
      timeout 300 python3 tools/bench_planner.py --breakdown --trace-dir "$OUT/traces" 2>&1 | tee "$OUT/bench_planner.md" ;;
    matvec)
      timeout 300 python3 tools/bench_matvec.py ${MATVEC_ARGS:-} 2>&1 | tee "$OUT/bench_matvec.md" ;;
    coopmat)
      timeout 300 python3 tools/bench_coopmat.py ${COOPMAT_ARGS:-} 2>&1 | tee "$OUT/bench_coopmat.md" ;;
    coop-chosen)
      # what models get: the default tiling unsplit beside coop_choose's pick, every swept type,
      # M 128/256/512, the llama8b shapes, with NVIDIA's register counts (~90 s on the H200)
      VKXSPLIT_PIPELINE_STATS=1 timeout 300 python3 tools/bench_coopmat.py --m 128,256,512 \
        --shapes 4096x4096,1024x4096,14336x4096,4096x14336 --splits 1 --tiles t128x128_k64_w32x64_s1 \
        --reps 8 2>&1 | tee "$OUT/bench_coop_chosen.md" | grep -E "chosen|Register|FAIL|checks" ;;
    ab)
      # whole-model A/B of kill switches (env AB_ARGS for tools/bench_ab.py, e.g.
      # --settings 'none;VKXSPLIT_DISABLE=splitk'; default: the split-K choice)
      timeout 400 python3 tools/bench_ab.py ${AB_ARGS:---shapes llama8b:q4_0} 2>&1 | tee "$OUT/bench_ab.md" ;;
    link)
      # GPU-side links between devices 0 and 1 through host pages (env LINK_ARGS)
      timeout 200 python3 tools/bench_link.py ${LINK_ARGS:-} 2>&1 | tee "$OUT/bench_link.md" ;;
    multigpu)
      timeout 400 python3 tools/bench_multigpu.py ${MULTIGPU_ARGS:-} 2>&1 | tee "$OUT/bench_multigpu.md" ;;
    hub-tests|pipeline-tests)
      # a model over two hubs (devices 0,1 on the 2-GPU machine: the hidden state and the
      # partials really cross between GPUs)
      VKXSPLIT_VALIDATION=1 VKXSPLIT_CACHE_DIR=/tmp/vkxcache timeout 300 python3 -m pytest -q -ra -p no:cacheprovider \
        -o addopts="" tests/test_hubs_layer.py tests/test_hubs_row.py tests/test_hubs_plan.py tests/test_link.py 2>&1 \
        | tee "$OUT/tests_hubs.log" | tail -15 ;;
    cuda-tests)
      VKXSPLIT_VALIDATION=1 VKXSPLIT_CACHE_DIR=/tmp/vkxcache timeout 200 python3 -m pytest -q -ra -p no:cacheprovider \
        -o addopts="" tests/test_backends.py tests/test_model.py -k "cuda or integer_dot" 2>&1 | tee "$OUT/tests_cuda.log" | tail -15 ;;
    cm2-tests)
      # the VK_NV_cooperative_matrix2 kernels, and the coopmat tests that now take them
      VKXSPLIT_VALIDATION=1 VKXSPLIT_CACHE_DIR=/tmp/vkxcache timeout 300 python3 -m pytest -q -ra -p no:cacheprovider \
        -o addopts="" tests/test_mul_mat_cm2.py tests/test_mul_mat.py -k "cm2 or (coopmat and not emu)" 2>&1 | tee "$OUT/tests_cm2.log" | tail -25 ;;
    cm2)
      # sweep of the mul_mat_cm2 tilings and splits (env CM2_ARGS for tools/bench_coopmat.py --cm2)
      VKXSPLIT_CACHE_DIR=/tmp/vkxcache timeout 400 python3 tools/bench_coopmat.py --cm2 ${CM2_ARGS:-} 2>&1 | tee "$OUT/bench_cm2.md" ;;
    cm2-chosen)
      # what models get with coopmat2: the chosen tiling and split per product, every swept
      # type, M 128/256/512, the llama8b shapes (Q4_K: mul_mat_coopmat, not a CM2_TYPES type)
      VKXSPLIT_CACHE_DIR=/tmp/vkxcache timeout 300 python3 tools/bench_coopmat.py --cm2 --m 128,256,512 \
        --shapes 4096x4096,1024x4096,14336x4096,4096x14336 --splits 1 --tiles w128x128_k64_n256 \
        --reps 8 2>&1 | tee "$OUT/bench_cm2_chosen.md" | grep -E "chosen|FAIL|checks" ;;
    mulmat-tests)
      VKXSPLIT_VALIDATION=1 VKXSPLIT_CACHE_DIR=/tmp/vkxcache timeout 300 python3 -m pytest -q -ra -p no:cacheprovider \
        -o addopts="" tests/test_mul_mat.py 2>&1 | tee "$OUT/tests_mul_mat.log" | tail -15 ;;
    info)
      python3 -m vkxsplit info > "$OUT/info.txt" 2>&1; python3 -m vkxsplit info --json > "$OUT/info.json" 2>&1
      head -60 "$OUT/info.txt" ;;
  esac
done
