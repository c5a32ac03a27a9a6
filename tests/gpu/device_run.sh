#!/usr/bin/env bash
# What to run on a lent machine with a CUDA GPU, torch and NIXL (nixl-cu13): the GPU tests,
# then the transfer bench on GPU memory (16 KiB and 1 MiB blocks, pulls and pushes) and on
# host memory, each JSON report written under $OUT (default /tmp/tandem-gpu). Bounded: each
# step has its own timeout, so one that hangs cannot take the rest with it.
set -u
out=${OUT:-/tmp/tandem-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout 180 python3 -m pytest --noconftest -q -s -p no:cacheprovider tests/gpu 2>&1 | tee "$out/tests-gpu.log"
bench() {  # name, then bench.transfer's arguments
    local name=$1; shift
    echo "== $name: $*"
    timeout 240 python3 -m bench.transfer --json --no-stock --idle-seconds 2 "$@" >"$out/$name.json"
    echo "   exit $?"; cut -c1-600 "$out/$name.json"; echo
}
bench transfer-vram-16k --memory vram --blocks 1024 --block-bytes 16384 --repeats 40
bench transfer-vram-1m --memory vram --blocks 512 --block-bytes 1048576 --repeats 40
bench transfer-dram-16k --memory dram --blocks 1024 --block-bytes 16384 --repeats 40
