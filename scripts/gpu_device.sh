#!/usr/bin/env bash
# One command on the GPU device (docs: /work/shared/reference/gpu_device.md): install the carried wheels (.whl/, NeMo
# AutoModel and its small needs, liger-kernel) into /tmp/site, then run the GPU benches and `pytest -m gpu tests/gpu`,
# logging everything to $OUT (or ./gpu_logs). Run from the repository root (or a staged copy of it):
#
#   bash scripts/gpu_device.sh [all|single|bench|tests|multi|single_tests|bench2|sync|sync_tests|moe|memory ...]
#   env: WHEELS, BENCH_SHAPES (split: GPU 0; BENCH_SHAPES_B: GPU 1), BENCH_GPU, BENCH_TAG, BENCH_ARGS,
#        BENCH2_SHAPES, PYTEST_ARGS, MULTI_K, SYNC_ARGS
#
# With 2+ GPUs the single-GPU bench runs on GPU 0 while the single-GPU tests run on GPU 1; the 2-GPU tests last.
# Several modes run in the order given (one wheel install).
set -uo pipefail
modes="${*:-all}"
OUT="${OUT:-$PWD/gpu_logs}"
mkdir -p "$OUT"
WHEELS="${WHEELS:-.whl}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d /tmp/site/nemo_automodel ]; then  # a warm machine: installed by the previous command
  export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}"
elif compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl > "$OUT/install.log" 2>&1 || { echo "wheel install failed"; tail "$OUT/install.log"; }
  export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}"
else
  export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpus.txt"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")

bench() {  # trainer vs plain-HF ceiling, one GPU; one JSON row per line in bench_1gpu${BENCH_TAG}.log
  local tag="${BENCH_TAG:-}" port=$((29500 + ${BENCH_GPU:-0}))
  CUDA_VISIBLE_DEVICES="${BENCH_GPU:-0}" timeout "${BENCH_TIMEOUT:-420}" torchrun --standalone --nproc_per_node=1 \
    --master-port=$port bench/gpu_trainer.py --out "$OUT/bench_1gpu$tag.json" \
    --shapes "${BENCH_SHAPES:-0.6b:0:hf,4b:0:hf,4b:1:hf,30b-a3b-8l:0:hf,4b:0:am,30b-a3b-8l:0:am,4b:0:hf+compile}" \
    ${BENCH_ARGS:-} > "$OUT/bench_1gpu$tag.log" 2>&1
  echo "bench$tag rc=$?"
}
single_tests() {
  local dev=$(( ngpu > 1 ? 1 : 0 ))
  CUDA_VISIBLE_DEVICES=$dev timeout "${TESTS_TIMEOUT:-480}" python3 -m pytest -p no:cacheprovider -m gpu -x -s \
    tests/gpu/test_automodel_gpu.py ${PYTEST_ARGS:-} > "$OUT/pytest_1gpu.log" 2>&1
  echo "1-GPU tests rc=$?"
}
multi_tests() {
  [ "$ngpu" -ge 2 ] || { echo "multi-GPU tests skipped: $ngpu GPU"; return; }
  timeout "${MULTI_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -m gpu -s tests/gpu \
    --ignore=tests/gpu/test_automodel_gpu.py ${MULTI_K:+-k "$MULTI_K"} > "$OUT/pytest_2gpu.log" 2>&1
  echo "2-GPU tests rc=$?"
}
bench2() {  # the same rows on 2 GPUs (weak scaling: same sequences per GPU), for the scaling table
  [ "$ngpu" -ge 2 ] || return
  timeout "${BENCH2_TIMEOUT:-240}" torchrun --standalone --nproc_per_node=2 bench/gpu_trainer.py \
    --out "$OUT/bench_2gpu.json" --shapes "${BENCH2_SHAPES:-4b:1:am,30b-a3b-8l:1:am+ep2}" ${BENCH2_ARGS:-} \
    > "$OUT/bench_2gpu.log" 2>&1
  echo "2-GPU bench rc=$?"
}
sync() {  # GPU weight sync (CUDA IPC on one GPU, NCCL GPU 0 -> 1) against a device copy / plain broadcast
  timeout "${SYNC_TIMEOUT:-240}" python3 bench/gpu_weight_sync.py --no-append ${SYNC_ARGS:-} > "$OUT/sync.log" 2>&1
  echo "sync rc=$?"
}
sync_tests() {  # the one-GPU weight-sync tests (CUDA IPC: bucketed, single pass, replayed copy plan) on GPU 0
  CUDA_VISIBLE_DEVICES=0 timeout "${SYNC_TESTS_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -m gpu -s \
    tests/gpu/test_weight_sync_gpu.py ${PYTEST_ARGS:-} > "$OUT/pytest_sync.log" 2>&1
  echo "weight-sync tests rc=$?"
}
moe() {  # issue 38: 30B-A3B shape (8 layers) HF experts grouped / transformers' grouped_mm / loop + the GPU test;
  # one process per compared row (2026-12-03: the second 30B row of one process found the first's 138 GiB still
  # allocated and ran out of memory building its optimizer), each warmed up first by a tiny-moe row (CUDA context,
  # cuBLAS, allocator)
  local i=0 shape
  : > "$OUT/bench_moe.log"
  for shape in $(echo "${MOE_SHAPES:-30b-a3b-8l:0:hf+mw+tfexperts,30b-a3b-8l:0:hf+mw+grouped,30b-a3b-8l:0:hf+mw+loop}" | tr , ' '); do
    i=$((i + 1))
    CUDA_VISIBLE_DEVICES=0 timeout "${MOE_TIMEOUT:-150}" torchrun --standalone --nproc_per_node=1 --master-port=29510 \
      bench/gpu_trainer.py --out "$OUT/bench_moe_$i.json" --gather 0 ${MOE_ARGS:-} --shapes "tiny-moe:0:hf+mw+grouped,$shape" \
      --profile "${MOE_PROFILE:-30b-a3b-8l:0:hf+mw+tfexperts|30b-a3b-8l:0:hf+mw+grouped}" >> "$OUT/bench_moe.log" 2>&1
    echo "moe bench $shape rc=$?"
  done
  CUDA_VISIBLE_DEVICES=0 timeout "${MOE_TESTS_TIMEOUT:-70}" python3 -m pytest -p no:cacheprovider -m gpu -s \
    tests/gpu/test_moe_experts_gpu.py > "$OUT/pytest_moe.log" 2>&1
  echo "moe tests rc=$?"
  grep -hE "^== [a-z0-9]|^   largest|relative error|passed|failed" "$OUT/bench_moe.log" "$OUT/pytest_moe.log"
}
memory() {  # issue 38: the largest 30B-A3B-layer MoE that trains on one GPU, AC off and on, 4 x 8,192 tokens a step;
  # one process per row (an OOM leaves nothing behind), layers rising until a row fails
  local ac layers
  : > "$OUT/bench_memory.log"
  for ac in 0 1; do
    for layers in ${MEMORY_LAYERS:-8 12 16 20 24}; do
      rm -f "$OUT/bench_memory_${ac}_$layers.json"  # a stale row must not decide; a killed row writes none
      CUDA_VISIBLE_DEVICES=0 timeout "${MOE_TIMEOUT:-150}" torchrun --standalone --nproc_per_node=1 \
        --master-port=29510 bench/gpu_trainer.py --out "$OUT/bench_memory_${ac}_$layers.json" --gather 0 --ceiling 0 \
        --mb-tokens 8192 --steps 1 --shapes "30b-a3b-${layers}l:$ac:hf+mw+grouped+compile:16" >> "$OUT/bench_memory.log" 2>&1
      [ -s "$OUT/bench_memory_${ac}_$layers.json" ] && ! grep -q '"error"' "$OUT/bench_memory_${ac}_$layers.json" || break
    done
  done
  grep -h "^== 30b" "$OUT/bench_memory.log"
}
for what in $modes; do
  case "$what" in
    install) ;;  # the wheels only
    bench) bench ;;
    bench2) bench2 ;;
    sync) sync ;;
    sync_tests) sync_tests ;;
    moe) moe ;;
    memory) memory ;;
    multi) multi_tests ;;
    single_tests) single_tests ;;
    tests) single_tests; multi_tests ;;
    split) BENCH_GPU=0 BENCH_TAG=_a bench & a=$!  # two benches at once, one per GPU; then the 1-GPU tests on GPU 1
       BENCH_GPU=1 BENCH_TAG=_b BENCH_SHAPES="${BENCH_SHAPES_B:-4b:0:hf}" bench; single_tests; wait $a ;;
    single) if [ "$ngpu" -ge 2 ]; then bench & b=$!; single_tests; wait $b; else bench; single_tests; fi ;;
    *) if [ "$ngpu" -ge 2 ]; then bench & b=$!; single_tests; wait $b; else bench; single_tests; fi
       multi_tests; bench2 ;;
  esac
done
grep -h '^{' "$OUT"/bench_*.log 2>/dev/null | cut -c1-400
grep -hE "passed|failed|error" "$OUT"/pytest_*.log 2>/dev/null | tail -5
