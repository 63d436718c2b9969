#!/usr/bin/env bash
# Run a list of GPU jobs (tests and benchmarks) one after another on a GPU machine, each under
# its own time limit, and pack every result into one archive.
#
#   bash benchmarks/gpu_session.sh OUTDIR JOB:SECONDS [JOB:SECONDS ...]
#
# Jobs (each regenerates a table or row of README.md's "Measured", or checks the GPU path):
#   gpu_tests     pytest -m gpu tests
#   sanitizer     compute-sanitizer memcheck over the graph-replay bitwise test
#   v1_8          verify_step.py --quick --bs 1 8      (verify step table, bs 1 and 8)
#   v64_256       verify_step.py --quick --bs 64 256   (verify step table, bs 64 and 256)
#   hybrid_step   hybrid_step.py                       (hybrid verify step table)
#   e2e           e2e.py                               (end-to-end table)
#   compile_cold  compile_time.py --label cold         (empty Inductor/Triton caches)
#   compile_warm  compile_time.py --label warm         (the caches compile_cold filled)
#   profile_step  profile_step.py --bs 64 256          (step profile row)
#   profile_small profile_step.py --bs 1 8             (the small-batch steps' exposed time a kind)
#   step_bound    step_bound.py                        (step bound row)
#   splitk_op     splitk_bmm.py --op                   (down projection over K chunks row)
#   jit_parallel  jit_parallel.py                      (parallel Triton JIT row)
#   attention     attention_kernel.py                  (the attention kernel alone)
#   ssd_kernels   ssd_kernels.py --sweep               (Mamba-2 and GDN verify ops vs state floor)
#   persistent_spike  persistent_spike.py              (the bs-1 matmul chain: launches, one
#                 persistent launch with grid barriers, a plain read of the same bytes)
#   packed_weights  packed_weights.py --shapes 8448x2048*64 --configs ... (the 16-row matmul
#                 stream with equal work a program, against the skinny launches and a plain read)
#   ssm_step      ssm_step.py                          (Nemotron-H-like verify step vs HF dense)
#   ssd_tests     pytest -m gpu tests/kernels/test_ssd_gpu.py (the Mamba-2 op, families, replays)
#   ssd_forms     ssd_kernels.py --kernels ssd --ssd-plans rows default (the SSD forward's row walk
#                 against plan_ssd's plan, bs 1 / 8 / 64 / 128)
#   ssd_block_plans  ssd_kernels.py --ssd-plans over the block form's knobs at bs 64 / 128
#   gdn_tests     pytest -m gpu over the GDN ops (both forms), the hybrid commit graphs and KDA
#   gdn_stream_dots  ssd_kernels.py --gdn-plans: the block form's stream products as float32 FMAs,
#                 bf16x3, tf32x2, tf32x3 (16 or 32 state rows a step), bs 64 / 128
#   gdn_forms     ssd_kernels.py --kernels gdn --gdn-plans rows default block (the row walk, plan_gdn's plan
#                 and the block form of the GDN forward, bs 1 / 8 / 64 / 128)
#   gdn_block_plans  ssd_kernels.py --gdn-plans over the block form's knobs at bs 64 / 128
#   ssd_one_launch  ssd_kernels.py --ssd-plans: the block form's launch (full-width requests) capped
#                 at 128 registers, and walking the other requests itself (no second launch),
#                 bs 64 / 128
#   ssd_walkers   ssd_kernels.py --mean-len 7: plan_ssd's plan against the block form with
#                 requests under 8 rows walking in a second launch, and the GDN forward's plan
#   ssd_from      ssd_kernels.py --mean-len 7, then 6: the shortest request the block form takes
#                 (block_from 8 / 6 / 5 / 4 / 1, requests under it walking in a second launch)
#                 against plan_ssd's plan
#   gdn_weights_launch  ssd_kernels.py --gdn-plans over the weight programs in a launch of their own
#                 (register caps 64 / 80 / 96 / none) against one launch, bs 64 / 128
#   gdn_probe_parts  gdn_block_probe.py 64 --variants op stream_only weights_only parts (where the
#                 block form's time goes at bs 64, each program's parts)
#   gdn_gram      ssd_kernels.py --gdn-plans: the weight programs' Gram products as float32 FMAs
#                 or one 16-bit product (twice each, alternating), bs 64 / 128
#   gdn_probe     gdn_block_probe.py 64 128 (the GDN block form's edited copies side by side: streams
#                 alone, weight programs alone, no flag, ticket roles; each program's clocks)
#   ssd_probe     ssd_block_probe.py 64 128 (the Mamba-2 block form's state stream alone, its tiles
#                 and pipelining depths, beside the op's two forms)
#   dsv4_step     dsv4_step.py                         (DeepSeek-V4-shaped verify step vs HF)
#   dsv4_attr     dsv4_step.py --bs 1 --attribute      (its bf16 logits: ours and HF vs float32)
#   dsv4_tests    pytest -m gpu on DeepSeek-V4 (kernels, float32 exactness, tier-graph replay)
#   dsa_tests     the sparse-attention kernels at DeepSeek-V3.2's and MiniMax-M3's shapes (pytest
#                 -m gpu), then the five DeepSeek Sparse Attention models and MiniMax-M3's
#                 block-sparse layers through the Triton lowering (zoo --device cuda, float32 and
#                 --static), results in zoo_gpu_dsa*.json
#   reach_tests   Inkling, JetMoE, ZAYA, BLOOM, RecurrentGemma, Zamba, the BERT family,
#                 MegatronBERT, RemBERT, RoFormer, GPT-J, CodeGen and the inline-attention
#                 families (GPT-Neo, XGLM, GPT, GPT-NeoX-Japanese, MPT; BioGPT; the BART
#                 family's decoders) on the GPU: their
#                 pytest -m gpu model tests, the relative-logit, row-sink and ALiBi kernel cases,
#                 and the models through the Triton lowering (zoo --device cuda),
#                 zoo_gpu_reach.json
#   reach_static  the same models through the tier session (--static), zoo_gpu_reach_static.json
#   dsa_zoo       dsa_tests' zoo runs alone (models this transformers lacks are skipped)
#   e2e_small     e2e.py --concurrency 1 8, default draft and --mean-accepted 1.5 (planner at c <= 8)
#   e2e_256       e2e.py --concurrency 256 --repeats 5, default draft and --mean-accepted 1.5
#   packed_rotate packed_weights.py --quick --rotate (the model chain's stream, tiles dealt on
#                 across matmuls)
#   stream_clocks packed_weights.py --shapes '2048x2048*128' --rotate --clocks (each program's
#                 start, end and multiprocessor in the o-shaped stream)
#   flow_chain    flow_chain.py (the bs-1 matmul chain as one persistent launch whose units wait
#                 only for the matmul before them)
#   ws_chain      ws_chain.py (the bs-1 matmul chain as one persistent warp-specialized launch:
#                 a producer warp streams weight tiles by TMA, never waiting for an activation)
#   ws_chain_layer  ws_chain.py --layer (the same chain with the layers' norms and SiLU done on
#                 each program's staged rows)
#   ws_chain_mma  ws_chain.py --stages 8 --tiles 16x512 --mma (the chain's units on the tensor
#                 cores beside the CUDA-core units; kept as ws_chain_forms/7_tensor_cores.json)
#   ws_step       ws_step.py --skips 0 1 2 8 11 --probe (the whole bs-1 verify step, attention
#                 included, as one persistent warp-specialized launch; compare with v1_8 in the
#                 same session)
#   ws_tests      pytest -m gpu over the persistent chain and step (ws_chain, ws_step: every form,
#                 the grouped tensor-core ones included)
#   ws_hand_over  ws_chain.py --stages 8 --tiles 16x512 --mma --warp-release, then ws_step.py
#                 --hand-over cta warp warp_mma warp_mma_b --skips 0 8 --probe --stress 6 (each
#                 warp taking and handing back ring slots on its own; the grouped tensor-core
#                 units; compare with v1_8 in the same session)
#   moe_steps     hybrid_step.py --variant a3b, then --variant moe (MoE verify steps vs HF)
#   moe_attr      hybrid_step.py --variant moe --attribute --check-only (its bf16 logits: ours
#                 and HF vs a float32 copy)
#   zoo_gpu       zoo --device cuda                    (every architecture, Triton lowering, fp32)
#   zoo_bf16      zoo --device cuda --dtype bfloat16   (the same in bf16: the fused skinny paths)
#   zoo_variants  zoo --device cuda --variants over the families the README names (past 280 s:
#                 zoo_variants_a and zoo_variants_b take its first and second 20 families)
#   zoo_fp16      zoo --device cuda --dtype float16    (float16 through the Triton lowering)
#   zoo_static    zoo --device cuda --dtype bfloat16 --static (every architecture in tier CUDA
#                 graphs, padded rows included)
#   moe_pdl       moe_layer.py --batch-sizes 64 256, then with --target pdl=false (is programmatic
#                 dependent launch why the layer's graph replay is slower than its eager calls?)
#   moe_profile   moe_layer.py --profile --batch-sizes 64 256, with and without PDL (each kernel's
#                 time and the gaps between kernels, eager and in graph replays)
#   moe_sustained moe_layer.py --sustained --batch-sizes 64 256 (each replay of a long run, with
#                 the SM clock, power and throttle reasons)
#   moe_gap       moe_layer.py --gap --batch-sizes 256 (the graph figure as time_calls takes it,
#                 each replay alone, and captures after a large block was freed, interleaved)
#   moe_layer     moe_layer.py --batch-sizes 1 8 64 256 (one MoE layer table)
#   moe_tiles     moe_layer.py --tiles --batch-sizes 256 64 (each projection's tiles, TMA as the
#                 target has it)
#   moe_hints     moe_layer.py --batch-sizes 8 64 256, then with --target experts_cache_hints=false
#   e2e_long      e2e.py --concurrency 1 8 --output 1024 --repeats 5, default draft and
#                 --mean-accepted 1.5 (runs long enough that a mode's repeats can be told apart)
#   e2e_long_default  the same, default draft only
#   trust_tests   pytest -m gpu: the causal conv's activations (SiLU, erf and tanh GELU, none;
#                 float32 tight, bf16) and the BERT-style attention refusal
#   longrope_zoo  zoo --device cuda --variants --variant rope_longrope over $LONGROPE, float32
#                 and bfloat16 (zoo_gpu_longrope_*.json)
#   aria_dbrx     zoo --device cuda over Aria's text model and DBRX (float32, bfloat16, bfloat16
#                 --static) and Aria's variants (zoo_gpu_aria_dbrx_*.json)
#   multimodal_zoo  zoo --device cuda over the multimodal LMs the CPU zoo verifies (text), float32
#                 and bfloat16 --static (zoo_gpu_multimodal_*.json; types this transformers lacks
#                 are left out)
#   ncu_paged     Nsight Compute counters of the attention at bs 64, the paged read of its bytes
#                 (its tiles; 64 keys on 8 warps) and a plain read of them (ncu_paged64.csv)
#   ncu           Nsight Compute counters of ncu_kernels.py's launches: the experts GEMMs at bs
#                 256 and 64, the GDN and Mamba-2 forwards and commits at bs 64 all 8, the skinny
#                 matmul at 3 rows (ncu_<case>.csv)
# The zoo jobs need DSPARK_COMMIT set where the tree is not a git checkout (a git archive).
# One-off A/B and probe jobs are in git history. Each job's output goes to
# OUTDIR/res/<job>.log and its result files to OUTDIR/res/; OUTDIR/results.tgz holds them all.
# A job that runs past its limit is stopped and the next one starts.
#
# The tests need expecttest (and gpu_tests runs 4 workers with pytest-xdist), which a bare GPU
# image may lack: put their wheels in .whl/ (ignored by git), e.g. `python3 -m pip download
# --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform
# manylinux2014_x86_64 -d .whl expecttest==0.3.0 pytest-xdist execnet`, and ship that folder
# with the tree; the wheels found there are installed to /tmp/site first.
set -u

job() {
  case $1 in
    gpu_tests)  # 4 workers, a file per worker, where pytest-xdist is there (.whl/ below)
      if python3 -c "import xdist" 2>/dev/null; then set -- -n 4 --dist loadfile; else set --; fi
      python3 -m pytest -q -m gpu tests -p no:cacheprovider -p no:logging "$@" ;;
    sanitizer) compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -m gpu \
        tests/test_gpu.py -k bitwise -p no:cacheprovider ;;
    v1_8) python3 benchmarks/verify_step.py --quick --bs 1 8 ;;
    v64_256) python3 benchmarks/verify_step.py --quick --bs 64 256 ;;
    hybrid_step) python3 benchmarks/hybrid_step.py ;;
    e2e) python3 benchmarks/e2e.py ;;
    compile_cold)  # empty Inductor and Triton caches, as on a new machine
      rm -rf /tmp/dspark_cold_cache
      TORCHINDUCTOR_CACHE_DIR=/tmp/dspark_cold_cache/inductor \
        TRITON_CACHE_DIR=/tmp/dspark_cold_cache/triton \
        python3 benchmarks/compile_time.py --label cold --trace-jit ;;
    compile_warm)  # the caches compile_cold filled: a second process on the same machine
      TORCHINDUCTOR_CACHE_DIR=/tmp/dspark_cold_cache/inductor \
        TRITON_CACHE_DIR=/tmp/dspark_cold_cache/triton \
        python3 benchmarks/compile_time.py --label warm ;;
    profile_step) python3 benchmarks/profile_step.py --bs 64 256 ;;
    profile_small) python3 benchmarks/profile_step.py --bs 1 8 ;;
    step_bound) python3 benchmarks/step_bound.py ;;
    splitk_op) python3 benchmarks/splitk_bmm.py --op ;;
    jit_parallel) python3 benchmarks/jit_parallel.py ;;
    attention) python3 benchmarks/attention_kernel.py ;;
    ssd_kernels) python3 benchmarks/ssd_kernels.py --sweep ;;
    persistent_spike) python3 benchmarks/persistent_spike.py ;;
    packed_rotate) python3 benchmarks/packed_weights.py --quick --rotate ;;
    flow_chain) python3 benchmarks/flow_chain.py ;;
    ws_chain) python3 benchmarks/ws_chain.py --stages 8 10 --tiles 16x512 8x1024 ;;
    ws_chain_layer) python3 benchmarks/ws_chain.py --layer --stages 8 --tiles 16x512 ;;
    ws_step) python3 benchmarks/ws_step.py --skips 0 1 2 8 11 --probe ;;
    ws_chain_mma) python3 benchmarks/ws_chain.py --stages 8 --tiles 16x512 --mma ;;
    ws_tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests/benchmarks/test_ws_chain_gpu.py \
        tests/benchmarks/test_ws_step_gpu.py ;;
    ws_hand_over) python3 benchmarks/ws_chain.py --stages 8 --tiles 16x512 --mma --warp-release &&
      python3 benchmarks/ws_step.py --hand-over cta warp warp_mma warp_mma_b --skips 0 8 --probe \
        --stress 6 ;;
    stream_clocks) python3 benchmarks/packed_weights.py --shapes '2048x2048*128' \
        --configs 64,128,4,5,1 --rotate --clocks ;;
    e2e_256) python3 benchmarks/e2e.py --concurrency 256 --repeats 5 &&
      python3 benchmarks/e2e.py --concurrency 256 --repeats 5 --mean-accepted 1.5 ;;
    packed_weights) python3 benchmarks/packed_weights.py --shapes '8448x2048*64' \
        --configs 64,128,4,5,1 32,256,4,6,1 64,128,4,5,2 ;;
    ssm_step) python3 benchmarks/ssm_step.py ;;
    ssd_tests) python3 -m pytest -q -m gpu tests/kernels/test_ssd_gpu.py -p no:cacheprovider ;;
    ssd_forms)  # the SSD forward's row walk against plan_ssd's plan (its block form from bs 8)
      python3 benchmarks/ssd_kernels.py --kernels ssd --bs 1 8 64 128 --ssd-plans rows default \
        && mv "$OUT/ssd_kernels.json" "$OUT/ssd_kernels_forms.json" ;;
    ssd_block_plans)  # the block form's shortest request, channel blocks, warps, launches
      python3 benchmarks/ssd_kernels.py --kernels ssd --bs 64 128 --ssd-plans rows block:from6 \
          block:from1 block:from4 block:from8 block:bp32 block:bw2 block:from1:one \
        && mv "$OUT/ssd_kernels.json" "$OUT/ssd_kernels_block_plans.json" ;;
    ssd_probe) python3 benchmarks/ssd_block_probe.py 64 128 ;;
    gdn_probe) python3 benchmarks/gdn_block_probe.py 64 128 ;;
    gdn_probe_parts) python3 benchmarks/gdn_block_probe.py 64 --variants op stream_only \
        weights_only parts \
        && mv "$OUT/gdn_block_probe.json" "$OUT/gdn_block_probe_parts.json" ;;
    gdn_gram)  # the weight programs' Gram products: float32 FMAs or one 16-bit product
      python3 benchmarks/ssd_kernels.py --kernels gdn --bs 64 128 --gdn-plans default \
          block:gram_ieee block:gram_native block:gram_ieee block \
        && mv "$OUT/ssd_kernels.json" "$OUT/ssd_kernels_gdn_gram.json" ;;
    ssd_one_launch)
      python3 benchmarks/ssd_kernels.py --kernels ssd --bs 64 128 --ssd-plans default \
          block:from8:wp0:r0 block:from8:wp0 block:from8 block:from8:r144 \
        && mv "$OUT/ssd_kernels.json" "$OUT/ssd_kernels_one_launch.json" ;;
    ssd_walkers)
      python3 benchmarks/ssd_kernels.py --bs 64 128 --mean-len 7 --ssd-plans default \
          block:from8:wp0:r0 block:from8:wp0 --gdn-plans default \
        && mv "$OUT/ssd_kernels.json" "$OUT/ssd_kernels_mean7.json" ;;
    ssd_from)
      for m in 7 6; do
        python3 benchmarks/ssd_kernels.py --kernels ssd --bs 64 128 --mean-len $m --ssd-plans \
            default block:from8:wp0 block:from6:wp0 block:from5:wp0 block:from4:wp0 \
            block:from1:wp0 \
          && mv "$OUT/ssd_kernels.json" "$OUT/ssd_kernels_from_mean$m.json" || exit 1
      done ;;
    gdn_weights_launch)
      python3 benchmarks/ssd_kernels.py --kernels gdn --bs 64 128 --gdn-plans block block:wl \
          block:wl:wr64 block:wl:wr80 block:wl:wr96 \
        && mv "$OUT/ssd_kernels.json" "$OUT/ssd_kernels_gdn_weights_launch.json" ;;
    gdn_stream_dots)  # the stream programs' products: float32 FMAs or tensor-core splits
      python3 benchmarks/ssd_kernels.py --kernels gdn --bs 64 128 --gdn-plans default \
          block:ieee block:bf16x3 block:tf32x2 block:tf32x3 block:bf16x3:kc32 block:tf32x2:kc32 \
        && mv "$OUT/ssd_kernels.json" "$OUT/ssd_kernels_gdn_stream_dots.json" ;;
    gdn_tests) python3 -m pytest -q -m gpu -p no:cacheprovider -p no:logging \
        tests/ops/test_linear_ops.py tests/frontend/test_kimi_linear.py tests/test_gpu.py -k \
        "gdn or conv or kimi or float32_on_gpu or hybrid or cuda_graph or opcheck" ;;
    gdn_forms)
      python3 benchmarks/ssd_kernels.py --kernels gdn --bs 1 8 64 128 \
          --gdn-plans rows default block \
        && mv "$OUT/ssd_kernels.json" "$OUT/ssd_kernels_gdn_forms.json" ;;
    gdn_block_plans)  # channels a program, register cap, warps, the weight programs last
      python3 benchmarks/ssd_kernels.py --kernels gdn --bs 64 128 --gdn-plans block \
          block:v32 block:v128:r168 block:w2 block:last \
        && mv "$OUT/ssd_kernels.json" "$OUT/ssd_kernels_gdn_block_plans.json" ;;
    dsv4_step) python3 benchmarks/dsv4_step.py ;;
    dsv4_attr) python3 benchmarks/dsv4_step.py --bs 1 --attribute ;;
    dsv4_tests) python3 -m pytest -q -m gpu -p no:logging -p no:cacheprovider \
        tests/frontend/test_deepseek_v4_gpu.py tests/kernels/test_compressed_gpu.py ;;
    dsa_tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_sparse_gpu.py &&
      job dsa_zoo ;;
    dsa_zoo) for extra in "" "--static"; do
        python3 -m dspark_compile zoo --device cuda --jobs 5 --timeout 200 $extra --skip-unknown \
          --only deepseek_v32 axk2 glm_moe_dsa dots3_note_text hy_v4 minimax_m3_vl_text \
          --out "$OUT/zoo_gpu_dsa${extra:+_static}.json" || exit 1
      done ;;
    reach_tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests/frontend/test_inkling.py \
        tests/frontend/test_zaya.py tests/frontend/test_bloom.py \
        tests/frontend/test_jetmoe.py tests/frontend/test_inline_attention.py \
        tests/frontend/test_counted_positions.py tests/frontend/test_bert_style_attention.py \
        tests/frontend/test_kv_shared_layers.py &&
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention_semantics.py \
        -k "relative or row_sinks or alibi" &&
      python3 -m dspark_compile zoo --device cuda --jobs 3 --timeout 200 \
        --only $REACH --out "$OUT/zoo_gpu_reach.json" ;;
    reach_static) python3 -m dspark_compile zoo --device cuda --jobs 3 --timeout 200 --static \
        --only $REACH --out "$OUT/zoo_gpu_reach_static.json" ;;
    e2e_small) python3 benchmarks/e2e.py --concurrency 1 8 &&
      python3 benchmarks/e2e.py --concurrency 1 8 --mean-accepted 1.5 ;;
    moe_steps) python3 benchmarks/hybrid_step.py --variant a3b &&
      python3 benchmarks/hybrid_step.py --variant moe ;;
    moe_attr) python3 benchmarks/hybrid_step.py --variant moe --attribute --check-only ;;
    zoo_gpu) python3 -m dspark_compile zoo --device cuda --jobs 14 --timeout 150 \
        --out "$OUT/zoo_gpu.json" ;;
    zoo_bf16) python3 -m dspark_compile zoo --device cuda --dtype bfloat16 --jobs 14 \
        --timeout 150 --out "$OUT/zoo_gpu_bf16.json" ;;
    zoo_fp16) python3 -m dspark_compile zoo --device cuda --dtype float16 --jobs 14 \
        --timeout 150 --out "$OUT/zoo_gpu_fp16.json" ;;
    zoo_static) python3 -m dspark_compile zoo --device cuda --dtype bfloat16 --static --jobs 14 \
        --timeout 150 --out "$OUT/zoo_gpu_static.json" ;;
    moe_pdl) python3 benchmarks/moe_layer.py --batch-sizes 64 256 &&
      python3 benchmarks/moe_layer.py --batch-sizes 64 256 --target pdl=false ;;
    moe_profile) python3 benchmarks/moe_layer.py --profile --batch-sizes 64 256 &&
      python3 benchmarks/moe_layer.py --profile --batch-sizes 64 256 --target pdl=false ;;
    moe_sustained) python3 benchmarks/moe_layer.py --sustained --batch-sizes 64 256 ;;
    moe_gap) python3 benchmarks/moe_layer.py --gap --batch-sizes 256 ;;
    moe_layer) python3 benchmarks/moe_layer.py --batch-sizes 1 8 64 256 ;;
    moe_tiles) python3 benchmarks/moe_layer.py --tiles --batch-sizes 256 64 ;;
    moe_hints) python3 benchmarks/moe_layer.py --batch-sizes 8 64 256 &&
      python3 benchmarks/moe_layer.py --batch-sizes 8 64 256 --target experts_cache_hints=false ;;
    e2e_long) python3 benchmarks/e2e.py --concurrency 1 8 --output 1024 --repeats 5 &&
      python3 benchmarks/e2e.py --concurrency 1 8 --output 1024 --repeats 5 --mean-accepted 1.5 ;;
    e2e_long_default) python3 benchmarks/e2e.py --concurrency 1 8 --output 1024 --repeats 5 ;;
    ncu)  # clocks left alone (the machine's notes); one process a case
      sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
        --section Occupancy --section LaunchStats --section SchedulerStats"
      for spec in "moe256 _experts_gemm|_combine 3 3 moe --bs 256" \
          "moe64 _experts_gemm|_combine 3 3 moe --bs 64" "gdn64 _gdn_ 2 2 gdn --bs 64" \
          "ssd64 _ssd_ 2 2 ssd --bs 64" "skinny3 _skinny_kernel 0 4 skinny --bs 3"; do
        set -- $spec
        name=$1 regex=$2 skip=$3 count=$4
        shift 4
        ncu --clock-control none --kernel-name "regex:$regex" --launch-skip "$skip" \
          --launch-count "$count" $sections --csv --page details \
          python3 benchmarks/ncu_kernels.py "$@" >"$OUT/ncu_$name.csv" || return 1
      done ;;
    zoo_variants) python3 -m dspark_compile zoo --device cuda --variants --jobs 14 --timeout 150 \
        --skip-unknown --only $ZOO_FAMILIES --out "$OUT/zoo_gpu_variants.json" ;;
    zoo_variants_a|zoo_variants_b)
      name=$1
      if [ "$name" = zoo_variants_a ]; then families=$(printf '%s\n' $ZOO_FAMILIES | head -n 20)
      else families=$(printf '%s\n' $ZOO_FAMILIES | tail -n +21); fi
      python3 -m dspark_compile zoo --device cuda --variants --jobs 14 --timeout 150 \
        --skip-unknown --only $families --out "$OUT/zoo_gpu_${name#zoo_}.json" ;;
    trust_tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_linear_ops.py \
        -k conv && python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/frontend/test_bert_style_attention.py ;;
    longrope_zoo) for dtype in float32 bfloat16; do
        python3 -m dspark_compile zoo --device cuda --dtype $dtype --variants --variant \
          rope_longrope --jobs 8 --timeout 150 --skip-unknown --only $LONGROPE \
          --out "$OUT/zoo_gpu_longrope_$dtype.json" || exit 1
      done ;;
    aria_dbrx) for extra in "--dtype float32" "--dtype bfloat16" "--dtype bfloat16 --static"; do
        python3 -m dspark_compile zoo --device cuda $extra --jobs 4 --timeout 200 \
          --only aria_text dbrx --out "$OUT/zoo_gpu_aria_dbrx_$(echo $extra | tr -d ' -').json"
      done
      python3 -m dspark_compile zoo --device cuda --variants --jobs 8 --timeout 200 \
        --only aria_text --out "$OUT/zoo_gpu_aria_variants.json" ;;
    multimodal_zoo) for extra in "--dtype float32" "--dtype bfloat16 --static"; do
        python3 -m dspark_compile zoo --device cuda $extra --jobs 8 --timeout 150 --skip-unknown \
          --only $MULTIMODAL --out "$OUT/zoo_gpu_multimodal_$(echo $extra | tr -d ' -').json"
      done ;;
    ncu_paged)  # the attention at bs 64 beside the paged and plain reads of its bytes
      ncu --clock-control none --kernel-name "regex:_ragged_attention_kernel|_paged_read|_read_k" \
        --launch-count 8 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section Occupancy \
        --section LaunchStats --section SchedulerStats --csv --page details \
        python3 benchmarks/ncu_kernels.py paged --bs 64 >"$OUT/ncu_paged64.csv" ;;
    *) echo "unknown job $1"; return 2 ;;
  esac
}

ZOO_FAMILIES="llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe qwen3_next gemma gemma2
  gemma3_text phi3 gpt_oss deepseek_v3 glm4 cohere2 granite starcoder2 olmo2 olmoe falcon gpt_neox
  smollm3 ernie4_5 seed_oss minimax_m2 nemotron_h granitemoehybrid lfm2 exaone4 hunyuan_v1_dense
  ministral falcon_h1 mamba2 bamba zamba2 jamba kimi_linear qwen3_5_text longcat_flash"

REACH="inkling_text jetmoe zaya bloom recurrent_gemma zamba gpt_neo xglm openai-gpt
  gpt_neox_japanese mpt biogpt bart mbart plbart blenderbot blenderbot-small marian pegasus
  mvp trocr bert electra ernie roc_bert roberta camembert megatron-bert rembert roformer
  gemma3n_text dory gptj codegen"

MULTIMODAL="aria aya_vision cohere2_vision cosmos3_edge cosmos3_omni deepseek_vl
  deepseek_vl_hybrid exaone4_5 gemma4_unified glm46v glm4v glm4v_moe glm_ocr glmasr glmga
  granite_speech granite_speech_plus hyperclovax_vision_v2 idefics2 idefics3 inkling_mm_model
  internvl janus kimi_k25 lfm2_vl lighton_ocr llava llava_next llava_next_video llava_onevision
  minicpm_ocr minicpmv4_6 minicpmv4_7 minimax_m3_vl mistral3 mistral4 nemotron_h_omni omniasr
  ovis2 paddleocr_vl pp_chart2table qianfan_ocr qwen2_5_vl qwen2_audio qwen2_vl qwen3_asr
  qwen3_vl qwen3_vl_moe shieldgemma2 smolvlm vibevoice_asr video_llama_3 video_llava vipllava
  voxtral"

LONGROPE="llama phi3 phimoe qwen2 qwen3 gemma2 gemma3_text mistral olmo2 deepseek_v3 glm4
  cohere2 granite stablelm"

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
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD  # this checkout's package; a script's folder is on sys.path by itself

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
