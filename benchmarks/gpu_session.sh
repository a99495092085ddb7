#!/bin/bash
# What a session with a lent GPU runs, in one call (about 8 minutes on one H100), so its device
# time goes to measuring. Prepare on the development machine first (no GPU needed):
#
#   mkdir -p .git/info && printf '/.whl/\n/.gpu/\n' >> .git/info/exclude
#   python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl ortools==9.15.6755 pydantic==2.13.4 pydantic-core==2.46.4 \
#       annotated-types==0.7.0 typing-inspection==0.4.2 immutabledict==4.3.1 protobuf==6.33.6
#   python benchmarks/gpu_step.py plan --out .gpu          # the plans, made with the supported torch
#
# then run `bash benchmarks/gpu_session.sh` on the device with .whl and .gpu carried; it leaves
# $OUT/results.tgz (step summaries, op profiles, GEMM alignment, AdamW variants, the machine's
# profile). Unpack it and compare with `python benchmarks/gpu_step.py report --out .gpu
# --cluster .gpu/profile.yaml`; commit the files under benchmarks/results/DEVICE-DATE/ as
# benchmarks/results/h100-2026-11-25/README.md describes.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())"
python3 -c "import autopar" || exit 4
timeout 330 python3 benchmarks/gpu_step.py run --out .gpu --steps 6 --timeout 120
timeout 40 python3 benchmarks/gpu_step.py gemm --out .gpu
# the NeMo 175B step's largest unmeasured term (README "the NeMo 175B step's missing time"): its GEMMs,
# the weight gradient added into an fp32 main_grad in place; an H100's figure (an H200's memory differs)
timeout 40 python3 benchmarks/gpu_step.py wgrad --out .gpu
timeout 60 python3 benchmarks/gpu_step.py optimizer --out .gpu --only gpt3-1.3b,llama-1b
for c in gpt3-1.3b llama-1b gpt2-medium; do
    timeout 60 python3 benchmarks/gpu_step.py profile --out .gpu --only "$c" 2>&1 | grep "^case"
done
timeout 200 python3 -m autopar profile -o .gpu/profile.yaml --processes 1 -q
tar czf "$OUT/results.tgz" .gpu/metrics .gpu/profile_*.txt .gpu/optimizer_*.txt .gpu/gemm_alignment.txt .gpu/wgrad_accum.txt .gpu/profile.yaml 2>/dev/null
ls -la "$OUT"
