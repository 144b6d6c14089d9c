#!/usr/bin/env bash
# The GPU loop against real vLLM, on a CUDA machine, in one command (docs/gpu.md):
#
#   bash scripts/gpu_e2e.sh [smoke] [tests] [bench] [throughput]     (default: smoke tests bench)
#   env: TESTS_K (a pytest -k expression for `tests`, e.g. "not r3"), PYTEST_ARGS (extra pytest args for `tests`, no
#   spaces inside one), THROUGHPUT_ARGS, BENCH_ARGS, OUT, RUNS
#
# smoke: vLLM starts on the GPU, sleeps (level 2: memory released), wakes and generates; tests: tests/gpu's real-vLLM
# suite (the colocated recipes through molt-run: learning, sleep, CUDA IPC, probe, vllm_kl, R3); bench: their metrics
# as bench rows (bench/gpu_colocated.py); throughput: also the Qwen3-4B-shaped colocated run. Needs vLLM's GPU build
# importable: `make install-gpu`; on the device (no registry) the staged site of ../shared/tools/gpu_stage
# (`source .stage/bin/env.sh` first). Logs and the rows go to $OUT (default ./gpu_logs).
set -uo pipefail
failed=0  # the script exits 1 when a step did (the log lines say which)
note_rc() { echo "$1 rc=$2"; [ "$2" -eq 0 ] || failed=1; }
OUT="${OUT:-$PWD/gpu_logs}"; RUNS="${RUNS:-/tmp/molt_gpu_runs}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import vllm, ray, torch; print('vllm', vllm.__version__, 'ray', ray.__version__, 'torch', torch.__version__,
torch.cuda.get_device_name())" 2>&1 | tail -1 | tee "$OUT/versions.txt"

smoke() {  # sleep mode needs CUDA's virtual memory API (vLLM's CuMemAllocator): the first thing to know on a machine
  cat > /tmp/molt_smoke.py <<'PY'
import os, torch
if __name__ == "__main__":
    from molt_hydra.models.tiny import resolve_model_path
    import vllm
    path = resolve_model_path("tiny://qwen3_0p6b_shape")
    llm = vllm.LLM(model=path, dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True, enable_sleep_mode=True)
    sp = vllm.SamplingParams(max_tokens=16, ignore_eos=True, seed=0, temperature=0)
    before = llm.generate(["Count: 12"], sp, use_tqdm=False)[0].outputs[0].token_ids
    free0 = torch.cuda.mem_get_info()[0]
    llm.sleep(level=1)
    free1 = torch.cuda.mem_get_info()[0]
    llm.wake_up()
    after = llm.generate(["Count: 12"], sp, use_tqdm=False)[0].outputs[0].token_ids
    print(f"SMOKE sleep freed {(free1 - free0) / 2**30:.2f} GiB; same greedy tokens after wake: {list(before) == list(after)}")
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)
PY
  timeout "${SMOKE_TIMEOUT:-240}" python3 /tmp/molt_smoke.py > "$OUT/smoke.log" 2>&1  # a file: vLLM spawns from it
  note_rc smoke $?; echo "$(grep SMOKE "$OUT/smoke.log")"
}
tests() {
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -p no:cacheprovider -m gpu -s -v --basetemp="$RUNS" \
    tests/gpu/test_colocated_vllm.py ${TESTS_K:+-k "$TESTS_K"} ${PYTEST_ARGS:-} > "$OUT/pytest_vllm.log" 2>&1
  note_rc "vLLM GPU tests" $?; grep -E "passed|failed|error" "$OUT/pytest_vllm.log" | tail -3
}
bench() {
  timeout "${BENCH_TIMEOUT:-540}" python3 bench/gpu_colocated.py --runs "$RUNS" ${BENCH_ARGS:-} \
    --out "$OUT/gpu_colocated.json" > "$OUT/bench.log" 2>&1
  note_rc bench $?; cut -c1-600 "$OUT/bench.log" | tail -8
}
consoles() {  # what each run printed, its failure report, the last errors in Ray's actor logs; every run's metrics
  for f in $(find "$RUNS" -name metrics.jsonl 2>/dev/null); do
    sed "s#^{#{\"run\": \"$(basename "$(dirname "$f")")\", #" "$f"; done > "$OUT/metrics_all.jsonl"
  for f in $(find "$RUNS" -name console.log -o -name failure.txt -o -name throughput_console.log 2>/dev/null); do
    echo "=== $f"; tail -c 6000 "$f"; done > "$OUT/consoles.log"
  for f in $(ls -t /tmp/ray/session_latest/logs/worker-*.err 2>/dev/null | head -6); do
    echo "=== $f"; grep -E "Error|error|Traceback|raise " "$f" | tail -20; done >> "$OUT/consoles.log"
}
for what in ${*:-smoke tests bench}; do
  case "$what" in
    smoke) smoke ;;
    tests) tests ;;
    bench) bench ;;
    throughput) BENCH_ARGS="--throughput ${THROUGHPUT_ARGS:-}" bench ;;  # e.g. "--set model.master_weights=optimizer"
  esac
done
consoles
exit $failed
