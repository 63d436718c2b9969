#!/usr/bin/env bash
# Run a list of GPU jobs (tests and benchmarks) one after another on a GPU machine, each under
# its own time limit, and pack every result into one archive.
#
#   bash benchmarks/gpu_session.sh OUTDIR JOB:SECONDS [JOB:SECONDS ...]
#
# Jobs: tests, tests_graphs, sanitizer, sanitizer_split, step_variants, verify_step, verify_step_grouped,
# verify_step_off, verify_step_rotary, verify_step_nofuse, profile_small, skinny_rows,
# skinny_fused, skinny_pdl, skinny_split, skinny_rope, verify_step_norope, profile_norope,
# tests_rope, verify_step_nopdl, verify_quick, verify_quick_norope, verify_quick_nopdl,
# verify_quick_keys64, verify_quick_noearly, verify_quick_rope16, verify_quick_noearlyw, tests_early, profile_nopdl, inductor_code,
# tests_skinny, tests_pdl, tests_meta,
# tests_step, profile_mid, mid_gemm, mid_tunable, v864, v64_256, v8, v8_split16, v64,
# v64_stages4, v1_8, v64_nosplit, splitk_op, hbm_read, step_bound, hbm_paged, attn_tiles, mid_rows,
# profile_step, profile_step_grouped, attention, attention_small, tests_attention, splitk, skinny,
# splitk_mid, compile_cold, compile_cold_noahead, compile_warm, tests_ahead, jit_parallel,
# hybrid_kernels, hybrid_step, rotary,
# runtime_device, profile_sps, linear, e2e_quick, e2e, e2e_grouped, e2e_off, e2e_replay,
# e2e_rotary. Each
# job's output goes to
# OUTDIR/res/<job>.log and its result files to OUTDIR/res/; OUTDIR/results.tgz holds them all.
# A job that runs past its limit is stopped and the next one starts.
#
# The tests need expecttest, which a bare GPU image may lack: put its wheel in .whl/ (ignored by
# git), e.g. `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux2014_x86_64 -d .whl expecttest==0.3.0`, and ship that
# folder with the tree; the wheels found there are installed to /tmp/site first.
set -u

job() {
  case $1 in
    tests) python3 -m pytest -q -m gpu tests -p no:cacheprovider ;;
    tests_graphs) python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_triton_linear.py \
        -p no:cacheprovider ;;
    sanitizer) compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -m gpu \
        tests/test_gpu.py -k bitwise -p no:cacheprovider ;;
    sanitizer_split) compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q \
        -m gpu tests/test_gpu.py tests/test_triton_skinny.py -k down_projection \
        -p no:cacheprovider ;;
    verify_step) python3 benchmarks/verify_step.py ;;
    verify_step_grouped) python3 benchmarks/verify_step.py --group-linears triton ;;
    verify_step_off) python3 benchmarks/verify_step.py --group-linears off ;;
    verify_step_nofuse) python3 benchmarks/verify_step.py --fuse-linears off ;;
    profile_small) python3 benchmarks/profile_step.py --bs 1 8 64 ;;
    skinny_rows) python3 benchmarks/skinny_kernel.py ;;
    skinny_fused) python3 benchmarks/skinny_kernel.py --fused-only ;;
    skinny_pdl) python3 benchmarks/skinny_kernel.py --pdl ;;
    skinny_rope) python3 benchmarks/skinny_kernel.py --rope-sweep --budget-s 140 ;;
    skinny_split) python3 benchmarks/skinny_kernel.py --split-sweep --budget-s 280 ;;
    verify_step_nopdl) python3 benchmarks/verify_step.py --target pdl=false ;;
    verify_step_norope) python3 benchmarks/verify_step.py --rotary-epilogue off ;;
    profile_norope) python3 benchmarks/profile_step.py --bs 1 8 --target pdl=false \
        --rotary-epilogue off ;;
    tests_rope) python3 -m pytest -q tests/test_triton_skinny.py -k rotary -p no:cacheprovider ;;
    verify_quick) python3 benchmarks/verify_step.py --quick ;;
    verify_quick_norope) python3 benchmarks/verify_step.py --quick --rotary-epilogue off ;;
    inductor_code)  # the packed graph's Inductor code for the bs 1 and 8 tiers
      TORCHINDUCTOR_CACHE_DIR=/tmp/ic_code python3 benchmarks/profile_step.py --bs 1 8 &&
        mkdir -p "$OUT/inductor_code" && grep -rl "def call" /tmp/ic_code --include=*.py |
        xargs -I{} cp {} "$OUT/inductor_code/" ;;
    verify_quick_nopdl) python3 benchmarks/verify_step.py --quick --target pdl=false ;;
    verify_quick_keys64) python3 benchmarks/verify_step.py --quick --target split_min_keys=64 ;;
    verify_quick_rope16) python3 benchmarks/verify_step.py --quick --target skinny_rope_min_m=16 ;;
    verify_quick_noearlyw) python3 benchmarks/verify_step.py --quick --target skinny_early_w_max_m=0 ;;
    verify_quick_noearly) python3 benchmarks/verify_step.py --quick --target attn_early_reads=false ;;
    tests_early) python3 -m pytest -q -m gpu tests/test_triton_attention.py tests/test_pdl.py \
        tests/test_gpu.py -p no:cacheprovider ;;
    profile_nopdl) python3 benchmarks/profile_step.py --bs 1 8 --target pdl=false ;;
    tests_skinny) python3 -m pytest -q tests/test_triton_skinny.py -p no:cacheprovider ;;  # fp16 and bf16
    tests_step) python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_pdl.py -p no:cacheprovider &&
      python3 -m pytest -q tests/test_triton_metadata.py -k 'not ahead_of_time' -p no:cacheprovider ;;
    tests_meta) python3 -m pytest -q tests/test_triton_metadata.py -k 'not ahead_of_time' \
        -p no:cacheprovider ;;
    tests_pdl) python3 -m pytest -q -m gpu tests/test_pdl.py tests/test_triton_skinny.py \
        -p no:cacheprovider ;;
    step_variants) python3 benchmarks/step_variants.py --profile ;;
    verify_step_rotary) python3 benchmarks/verify_step.py --rotary inductor ;;
    profile_step) python3 benchmarks/profile_step.py ;;
    profile_mid) python3 benchmarks/profile_step.py --bs 64 256 ;;
    mid_gemm) python3 benchmarks/mid_gemm.py --budget-s 240 ;;
    mid_tunable) python3 benchmarks/mid_gemm.py --tunable ;;
    mid_rows) python3 benchmarks/mid_gemm.py --rows 192 --rows-resident \
        --shapes gate_up qkv lm_head o --budget-s 260 ;;
    v64_256) python3 benchmarks/verify_step.py --quick --bs 64 256 ;;
    v8) python3 benchmarks/verify_step.py --quick --bs 8 ;;
    v64) python3 benchmarks/verify_step.py --quick --bs 64 ;;
    v64_stages4) python3 benchmarks/verify_step.py --quick --bs 64 --target attn_num_stages=4 ;;
    v1_8) python3 benchmarks/verify_step.py --quick --bs 1 8 ;;
    v8_split16) python3 benchmarks/verify_step.py --quick --bs 8 --target split_waves=4 \
        --target split_min_keys=64 ;;
    v864) python3 benchmarks/verify_step.py --quick --bs 8 64 ;;
    profile_step_grouped) python3 benchmarks/profile_step.py --group-linears triton ;;
    attention) python3 benchmarks/attention_kernel.py ;;
    hybrid_kernels) python3 benchmarks/hybrid_kernels.py ;;
    hybrid_step) python3 benchmarks/hybrid_step.py ;;
    rotary) python3 benchmarks/rotary.py ;;
    runtime_device)  # share of this session's bs-256 verify step, when verify_step ran first
      ms=$(python3 -c "import json; print(json.load(open('$OUT/verify_step.json'))['results']['256']['ours_graph_mix3_ms'])" 2>/dev/null)
      python3 benchmarks/runtime_device.py ${ms:+--verify-ms $ms} ;;
    profile_sps) python3 -m dspark_compile profile-sps --config benchmarks/configs/llama-1b \
        --max-requests 256 --block 8 --context 1024 --out "$res/sps_h200.json" ;;
    linear) python3 benchmarks/linear_kernel.py --sweep ;;
    splitk) python3 benchmarks/splitk_bmm.py ;;
    splitk_mid) python3 benchmarks/splitk_bmm.py --rows 192 768 ;;
    splitk_op) python3 benchmarks/splitk_bmm.py --op ;;
    hbm_read) python3 benchmarks/hbm_read.py ;;
    step_bound) python3 benchmarks/step_bound.py ;;
    hbm_paged) python3 benchmarks/hbm_read.py --paged ;;
    attn_tiles) python3 benchmarks/attention_kernel.py --tiles 32,4,3,128 64,8,3,none \
        64,8,2,none 64,8,4,none 32,8,3,none 64,4,3,128 128,8,2,none 32,4,3,128 ;;
    v64_nosplit) python3 benchmarks/verify_step.py --quick --bs 64 --target mid_split_k=1 ;;
    skinny) python3 benchmarks/skinny_kernel.py --sweep ;;
    compile_cold)  # empty Inductor and Triton caches, as on a new machine
      rm -rf /tmp/dspark_cold_cache
      TORCHINDUCTOR_CACHE_DIR=/tmp/dspark_cold_cache/inductor \
        TRITON_CACHE_DIR=/tmp/dspark_cold_cache/triton \
        python3 benchmarks/compile_time.py --label cold --trace-jit ;;
    compile_cold_noahead)  # the same, each kernel compiled when a capture first launches it
      rm -rf /tmp/dspark_cold_cache2
      TORCHINDUCTOR_CACHE_DIR=/tmp/dspark_cold_cache2/inductor \
        TRITON_CACHE_DIR=/tmp/dspark_cold_cache2/triton \
        python3 benchmarks/compile_time.py --label cold_noahead --no-ahead --trace-jit ;;
    tests_ahead) python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_launch.py \
        -k "compile_ahead or bitwise or hybrid_commit" -p no:cacheprovider ;;
    compile_warm)  # the caches compile_cold filled: a second process on the same machine
      TORCHINDUCTOR_CACHE_DIR=/tmp/dspark_cold_cache/inductor \
        TRITON_CACHE_DIR=/tmp/dspark_cold_cache/triton \
        python3 benchmarks/compile_time.py --label warm ;;
    jit_parallel) python3 benchmarks/jit_parallel.py ;;
    attention_small) python3 benchmarks/attention_kernel.py --small-sweep ;;
    tests_attention) python3 -m pytest -q tests/test_triton_attention.py -p no:cacheprovider ;;
    e2e_quick) python3 benchmarks/e2e.py --quick ;;
    e2e) python3 benchmarks/e2e.py ;;
    e2e_grouped) python3 benchmarks/e2e.py --group-linears triton ;;
    e2e_off) python3 benchmarks/e2e.py --group-linears off ;;
    e2e_replay) python3 benchmarks/e2e.py --replay-rates ;;
    e2e_rotary) python3 benchmarks/e2e.py --rotary inductor ;;
    *) echo "unknown job $1"; return 2 ;;
  esac
}

if [ "${1:-}" = "--one" ]; then  # one job, under the caller's timeout
  job "$2"
  exit $?
fi
out=${1:?usage: gpu_session.sh OUTDIR JOB:SECONDS ...}
shift
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
res=$out/res
mkdir -p "$res"
export PYTHONUNBUFFERED=1 OUT=$res
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/benchmarks

for spec in "$@"; do
  name=${spec%%:*}
  limit=${spec##*:}
  start=$(date +%s)
  echo "=== $name (limit ${limit}s)" | tee -a "$res/session.log"
  timeout -k 10 "$limit" bash "$0" --one "$name" >"$res/$name.log" 2>&1
  rc=$?
  echo "=== $name rc=$rc in $(( $(date +%s) - start ))s" | tee -a "$res/session.log"
  tail -n 15 "$res/$name.log"
done
tar czf "$out/results.tgz" -C "$out" res
