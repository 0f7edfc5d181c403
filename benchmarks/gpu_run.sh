#!/usr/bin/env bash
# The three prepared GPU scripts in one call on a lent GPU machine, each with a time limit, JSON under $OUT.
#
# The machine has Python 3.12, torch, Triton and transformers but no network and neither pydantic, tyro nor
# megatron-core: carry them as wheels in .gpu_wheels (benchmarks/README.md, "gpu_run.sh"). Each part runs in its own
# process under `timeout`, so one that hangs or dies leaves the others their time; each script writes its JSON as it
# goes, so a part cut short keeps what it measured. Order: what the issue asks first (trainer vs engine bits on CUDA,
# batch invariance and per-op speed; planner vs the allocator; Megatron step parity), the ~0.9B end to end last.
#
#     bash benchmarks/gpu_run.sh [PART...]   # on the GPU machine, OUT set; about 8 minutes at most
#     OUT=/tmp/gpu_dry bash benchmarks/gpu_run.sh --dry-run [PART...]   # here: the same steps on the CPU, tiny sizes
#
# PART: kernels_ops, megatron, memory, kernels_model (all of them when none is named).
set -u
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
SRC=packages/miles-contracts/src:packages/miles-kernels/src:packages/miles-memory/src:packages/miles-trainer/src
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY=1
    shift
fi
PARTS=("${@:-kernels_ops megatron memory kernels_model}")
PARTS=(${PARTS[*]})
if ((DRY)); then
    PY=(uv run --with megatron-core==0.16.1 python)
    KERNELS=(--quick) MEMORY=(--device cpu --tokens 512 --sequence-length 128) MEGATRON=(--device cpu --rl-deterministic-steps 0)
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu_wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$SRC
    PY=(python3)
    KERNELS=() MEMORY=() MEGATRON=(--rl-steps 0 --rl-deterministic-steps 0)
fi

{
    date -u
    nvidia-smi || true
    lscpu | grep -E "Model name|^CPU\(s\)" || true
    "${PY[@]}" -c "import torch, triton, transformers, megatron.core as m, pydantic
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__,
      'transformers', transformers.__version__, 'megatron-core', m.__version__, 'pydantic', pydantic.__version__)"
} > "$OUT/machine.txt" 2>&1

part() {  # part SECONDS NAME COMMAND...: run one part under a time limit, its output appended to the log
    local seconds=$1 name=$2
    shift 2
    [[ " ${PARTS[*]} " == *" ${name%%_ckpt} "* ]] || return 0  # memory_ckpt runs with the part memory
    local began=$SECONDS
    echo "=== $name (limit ${seconds}s)" >> "$LOG"
    timeout --kill-after=10 "$seconds" "$@" >> "$LOG" 2>&1
    echo "=== $name: exit $? after $((SECONDS - began))s" >> "$LOG"
}

part 150 kernels_ops "${PY[@]}" benchmarks/kernels_gpu.py "${KERNELS[@]}" --parts on_policy ops --repeats 5 \
    --out "$OUT/kernels_gpu.json"
part 120 megatron "${PY[@]}" benchmarks/megatron_gpu.py "${MEGATRON[@]}" --out "$OUT/megatron_gpu.json"
# one process per checkpointing mode: the second step's peak must not hold the first backend's memory
part 45 memory "${PY[@]}" benchmarks/memory_gpu.py "${MEMORY[@]}" --checkpointing off --out "$OUT/memory_gpu.json"
part 45 memory_ckpt "${PY[@]}" benchmarks/memory_gpu.py "${MEMORY[@]}" --checkpointing on \
    --out "$OUT/memory_gpu_checkpointing.json"
part 200 kernels_model "${PY[@]}" benchmarks/kernels_gpu.py "${KERNELS[@]}" --parts model --repeats 5 \
    --out "$OUT/kernels_gpu_model.json"
grep "^===" "$LOG"
