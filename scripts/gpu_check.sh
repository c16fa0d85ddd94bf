#!/usr/bin/env bash
# The GPU checks, as one run on a machine with a CUDA device and no package registry: Ray and the
# project's few missing dependencies come as wheels (and a trimmed Ray tarball) in .whl/.
#   tests/gpu (NCCL + bf16 FSDP2, the health probe, the NCCL flight recorder, pinned staging, a
#   real Ray job whose killed CUDA worker resumes bit-exact), bench/cuda_stall.py, and the demo
#   job on CUDA through the CLI (a local Ray, a killed rank, the restart), logs into $OUT.
#
# On a machine with a registry, `bash scripts/gpu_check.sh --fetch` fills .whl/ first (Ray without
# its Java jars and libraries the checks do not use, xz-packed to travel under 64 MiB); then, on
# the GPU machine, from the repository root: `bash scripts/gpu_check.sh`.
set -u
if [ "${1:-}" = "--fetch" ]; then
    set -e; mkdir -p .whl; tmp=$(mktemp -d)
    plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    python3 -m pip download -q --no-deps "${plat[@]}" -d .whl pydantic==2.14.4 pydantic-core==2.50.5 \
        annotated-types typing-inspection typing-extensions jsonschema jsonschema-specifications referencing rpds-py crc32c
    python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" ray==2.60.0
    (cd "$tmp" && unzip -q ray-*.whl && rm -rf ray-*.whl ray/jars ray/rllib ray/serve ray/data ray/llm \
        && tar cf - ray ray-*.dist-info | xz -T0 -6 >"$OLDPWD/.whl/ray-2.60.0-trim.tar.xz")
    rm -rf "$tmp"; exit 0
fi
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT" /tmp/site
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
tar xJf .whl/ray-*.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; python3 -c "import torch, ray, raytrain_ckpt; print('torch', torch.__version__, 'ray', ray.__version__)" || exit 1
echo "== tests/gpu"
timeout 270 python3 -m pytest tests/gpu -s -p no:cacheprovider --durations=0 2>&1 | tee "$OUT/gpu_tests.log" | tail -60
echo "== bench/cuda_stall.py"
timeout 150 python3 bench/cuda_stall.py --gib 4 --reps 2 --dir /tmp/rtc-bench 2>&1 | tee "$OUT/cuda_stall.log" | tail -15
echo "== the demo job on CUDA through the CLI, rank 0 killed after step 30"
RAYTRAIN_CKPT_FAULTS="exit@step:rank=0,step=30" timeout 90 python3 -m raytrain_ckpt run jobs/llama_debug_fsdp.yaml --address local \
  --set resources.use_gpu=true --set resources.num_workers=1 --set parallelism.dp_shard=1 \
  --set checkpoint.mode=async --set checkpoint.dir=/tmp/gpu-demo --set checkpoint.interval_steps=10 \
  --set training.log_every_steps=10 2>&1 | tee "$OUT/cli_job.log" | tail -40
