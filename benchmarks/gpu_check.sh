#!/usr/bin/env bash
# The one prepared check for a lent GPU machine: CUDA correctness in bfloat16 (bitwise restore,
# same answer, only the suffix run, pinned staging), then resume, crossover and chunked-prefill
# figures. That machine has no registry access and no copy of the default model, so it gets the
# model's config and tokenizer (3.4 MB; the weights are built at random there, same shapes, same
# speed) and a zstandard wheel. Prepare both here (.gitignore keeps them out of commits):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl zstandard==0.25.0
#   .venv/bin/python benchmarks/shaped_model.py --export .gpu
#
# then run `bash benchmarks/gpu_check.sh` there, with .whl and .gpu in the device tool's carry
# (about 7-8 minutes there). QUICK=1 runs small sizes (a dry run on the CPU here:
# `QUICK=1 bash benchmarks/gpu_check.sh`). Figures land in $OUT (or benchmarks/results/gpu);
# the exit status is non-zero if a check failed.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
py=python3
[ -x .venv/bin/python ] && [ -z "${OUT:-}" ] && py=.venv/bin/python
# Results go straight to $out, so a run stopped at its time limit still returns what it finished
# (and a dry run here leaves benchmarks/results alone).
export KVSNAP_BENCH_RESULTS="$out"
if ! $py -c "import zstandard" 2>/dev/null; then
    compgen -G ".whl/*.whl" >/dev/null || { echo "zstandard is missing and no wheel was carried in .whl"; exit 2; }
    echo "installing $(ls .whl) for $($py -c 'import sys; print(sys.version.split()[0])')"
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
        { echo "the carried wheels do not install here (a wheel for another Python version?)"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -f .gpu/config.json ] || { echo "no .gpu/config.json: run benchmarks/shaped_model.py --export .gpu first"; exit 2; }

if [ -n "${QUICK:-}" ]; then
    check=512 lengths="256 1024" sweep="64 256 1024" chunk_tokens=1024 chunks="256 1024"
else
    # Up to the model's 8192-token context (max_position_embeddings); a resume's prompt must leave
    # room for the answer, hence 8000. resume.py's new-process runs took ~135 s a length on the H200
    # machine (2026-12-01), the other steps ~200 s together: two lengths keep the whole under 10 min.
    check=4096 lengths="1024 8000" sweep="64 256 1024 4096 8192" chunk_tokens=8192 chunks="512 2048 8192"
fi
model=/tmp/kvsnap-shaped-model
rm -rf "$model"
$py benchmarks/shaped_model.py .gpu "$model" 2>&1 | grep -v "it/s]" | tail -20
[ -f "$model/config.json" ] || { echo "could not build the shaped model"; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

status=0
step() {
    echo "== $*" | tee -a "$out/log.txt"
    "$@" 2>&1 | grep -v -e "it/s]" -e "^Warning" | tee -a "$out/log.txt"
    local s=${PIPESTATUS[0]}
    [ "$s" -eq 0 ] || status=$s
}
step $py benchmarks/cuda_check.py --model "$model" --tokens $check
# The load-or-recompute cost model (--reuse auto) as measured there (the library only: no typer there).
step $py -c "import json, sys; from kvsnap.models import load_model; from kvsnap.engine.calibrate import calibrate
print(json.dumps(calibrate(load_model(sys.argv[1])).to_json()))" "$model"
# shellcheck disable=SC2086
step $py benchmarks/resume.py --model "$model" --lengths $lengths --repeats 2
# shellcheck disable=SC2086
step $py benchmarks/crossover.py --model "$model" --lengths $sweep
# shellcheck disable=SC2086
step $py benchmarks/chunked.py --model "$model" --tokens $chunk_tokens --chunks $chunks
echo "exit status $status"
exit $status
