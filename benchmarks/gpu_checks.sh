#!/usr/bin/env bash
# The checks a lent GPU machine runs, in one go, most important first; each step has its own
# time limit so that one hang cannot eat the rest. Logs go to $OUT (or ./gpu-logs).
#
#   [STEPS="engine host tests kernel_tests ..."] bash benchmarks/gpu_checks.sh [--quick]
#
# One device call runs at most 600 s, and a session's device time (15 minutes, the machine's
# start included) fits about two calls of the size below, most important first. A warm machine
# goes back after 30 s idle: have the second call's arguments ready before the first returns.
# Next (as of 2026-12-04), in two calls on one machine (the recipe below):
#   1. STEPS="host kernel_profile" while Ray's first part crosses (host: 107 s on an H200; the
#      profile runs print each kind of step's device time, and show why the offline run's steps
#      with a prompt chunk took 38 ms on 2026-12-04 against 17-24 ms on 2026-11-29);
#   2. STEPS="served" with SERVED_REPLICAS="auto,1,auto": the default (two ingress replicas per GPU
#      worker) before and after one replica (at most 55 + 3 x 125 s). On 2026-12-04 the default,
#      run once after one replica, streamed 0.72x of one replica's tok/s, with every process
#      slower per token, the engine core's forward too; the order tells the replica count from
#      the machine. Each served run now warms up with a whole burst (about 5 s more a run): the
#      2026-12-04 run's part-full steps (538 against 292 offline) had the shape of a burst on
#      new connections to the replica on the CPU VM (docs/benchmarks.md).
#   3. If time is left: SERVED_EVENT_LOOP=uvloop SERVED_REPLICAS=1 STEPS="served", beside the default
#      (asyncio): where the replica sets the rate, uvloop's 1-3 µs less a token may be worth its slow
#      accepts of a burst's new connections (docs/benchmarks.md, "A burst on new connections").
# In a later session: STEPS="kernel_tiles", then "engine", then "spec lora" (the verification
# cost against a one-token step, LoRA's step cost on the GPU). "kernel_tests" passed on an H200 on
# 2026-11-29 (540 tests); test_cuda_greedy's speculation tests and test_lora's CUDA graph test
# passed on one on 2026-12-04.
#
# "tp" is for a machine with several GPUs (it says so and passes on one).
#
# "served" (benchmarks/bench_served_gpu.py) streams the default workload through `pagedserve serve`
# over HTTP against LLM.generate in the same call, and reads every server process's CPU per token
# and the engine's decode step while served. On an H200 the offline part takes about 55 s and each
# served run about 120 s (the server's start most of it).
# It needs Ray on the machine. Ray's wheel (cp312, manylinux2014 x86_64, about 79 MB) is over one
# call's 64 MiB, so it travels in two parts in two calls on the warm machine, which keeps /tmp
# between calls (a fresh machine does not). `bash benchmarks/gpu_wheels.sh` (here, with a package
# registry) lays out .whl/: Ray's two parts and their sha256 in .whl/parts/, the other wheels the
# machine lacks in two halves, .whl/deps1 (with everything the engine's steps import) and
# .whl/deps2. Then:
#   call 1: carry .whl/parts/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl.part-aa, its .sha256 and
#           .whl/deps1; command: STEPS="host kernel_profile" bash benchmarks/gpu_checks.sh
#   call 2: carry .whl/parts/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl.part-ab and .whl/deps2;
#           command: SERVED_REPLICAS="auto,1,auto" STEPS="served" bash benchmarks/gpu_checks.sh
# This script keeps what each call carries in /tmp, joins Ray's parts once they are all there
# (the .sha256 says so), and installs every wheel kept so far.

# Needs torch with CUDA, triton and transformers installed. Python packages that machine
# lacks travel as wheels in .whl/ (installed to /tmp/site), and .whl/site/ holds packages
# copied as they are (an abi3 build, say).
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
QUICK=${1:-}
export PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE_DIR=/tmp/pagedserve-models

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    tail -n 25 "$OUT/$name.log"
}

nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name(0))"

# Wheels carried in .whl/ (and one folder down) are kept in $WHEELS, which a warm machine keeps
# between calls, and the whole kept set is installed at once: pip's --target replaces a package's
# folder whole, so a namespace package split over two calls' installs (opentelemetry) would lose
# the first call's half. A wheel carried in parts over two calls (.whl/parts/NAME.part-*) is joined
# once its parts are all there: its NAME.sha256 (`sha256sum` of the whole wheel, named .whl/NAME)
# travels with the first part.
WHEELS=/tmp/pagedserve-wheels
mkdir -p "$WHEELS/parts"
if [ -d .whl ]; then
    find .whl -maxdepth 2 -type f -name '*.whl' -not -path '.whl/site/*' -exec cp {} "$WHEELS/" \;
    [ -d .whl/parts ] && cp .whl/parts/* "$WHEELS/parts/" 2>/dev/null
fi
for first in "$WHEELS"/parts/*.part-aa; do
    [ -e "$first" ] || continue
    name=$(basename "${first%.part-aa}")
    [ -e "$WHEELS/$name" ] && continue
    cat "$WHEELS/parts/$name".part-* > "$WHEELS/$name"
    if [ -f "$WHEELS/parts/$name.sha256" ] \
            && ! (cd "$WHEELS" && sed "s#  .whl/#  #" "parts/$name.sha256" | sha256sum --quiet -c - > /dev/null 2>&1); then
        echo "$name: not all its parts are here yet, not installed"
        rm -f "$WHEELS/$name"
    fi
done
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl
fi
[ -d .whl/site ] && mkdir -p /tmp/site && cp -r .whl/site/. /tmp/site/
# pagedserve itself, with its optional native key set if this machine's compiler builds it.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . > "$OUT/install.log" 2>&1 \
    || { echo "pip install of pagedserve failed:"; tail -5 "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

# Engines end to end (test_cuda_greedy: CUDA graphs of the compiled forward, of the uncompiled
# one, and eager; no kernel variant compiles after load), then the kernels and the sampler alone.
TESTS=(tests/test_cuda_greedy.py tests/test_kernel_variants.py tests/test_sampler.py
       "tests/test_structured_outputs.py::test_structured_outputs_on_cuda"
       "tests/test_lora.py::test_lora_decode_steps_replay_cuda_graphs_on_cuda")
KERNEL_TESTS=(tests/test_gpu_targets.py tests/test_kernels_triton.py tests/test_kernels_torch.py
              tests/test_sampling_extensions.py tests/test_lora_kernels.py)
for name in ${STEPS:-engine host tests kernel_tests launches kernels sweep}; do
    case $name in
        kernels) step bench_kernels 150 python3 benchmarks/bench_kernels_gpu.py ;;
        tests) step tests 300 python3 -m pytest -q -p no:cacheprovider -o addopts= -rs -s --durations=10 "${TESTS[@]}" ;;
        kernel_tests) step kernel_tests 300 python3 -m pytest -q -p no:cacheprovider -o addopts= -rs --durations=10 \
                          "${KERNEL_TESTS[@]}" ;;
        # Decode step time at 4 and 256 sequences, llama-1b in bf16, CUDA graphs on, with the device's
        # share of it (step events); and what an output channel's request costs the output thread
        # per token on this host's CPU.
        host) step host_cost 200 python3 -m pagedserve.bench.host_cost --size 1b --device cuda --dtype bfloat16 \
                  --steps 32 --repeats 2 --output-kinds final,channel,tokens --json "$OUT/host_cost.json" ;;
        # Kernels per decode step and per layer, llama-1b bf16: compiled (graph replays count 1,
        # so the compiled forward runs without graphs here) against eager.
        launches) step launches 150 bash -c "python3 benchmarks/bench_launches.py --size 1b --device cuda --dtype bfloat16 --enforce-eager --torch-compile --json $OUT/launches_compiled.json && python3 benchmarks/bench_launches.py --size 1b --device cuda --dtype bfloat16 --enforce-eager --json $OUT/launches_eager.json" ;;
        structured) step structured 60 python3 -m pytest -q -p no:cacheprovider -o addopts= -rs "${TESTS[3]}" ;;
        # pagedserve with compiled graphs, uncompiled graphs and eager, transformers' two; the roofline column,
        # and the device time of pagedserve's decode steps and steps with a prompt chunk (CUDA events).
        engine) step bench_engine 290 python3 benchmarks/bench_engine_gpu.py $QUICK --json "$OUT/bench_engine.json" ;;
        sweep) step split_sweep 100 python3 benchmarks/bench_kernels_gpu.py --sweep --dtypes float16 ;;
        # The prefill kernel's FLOP rate on whole prompts and on chunks after a cached context,
        # with its default tiles and others, against causal SDPA (flash) and a matmul; then the
        # decode kernel's default tiles against others, as fractions of the copy rate.
        kernel_tiles) step kernel_tiles 200 bash -c "python3 benchmarks/bench_kernels_gpu.py --prefill --dtypes bfloat16 \
                          && python3 benchmarks/bench_kernels_gpu.py --decode-tiles --dtypes bfloat16" ;;
        # Device time by kernel kind (matmuls, paged attention, fused, copies) against the wall
        # time, under torch.profiler: the default workload, then the prefill-heavy one.
        kernel_profile) step kernel_profile 240 bash -c "python3 benchmarks/bench_engine_gpu.py --contenders pagedserve \
                            --kernel-profile --json $OUT/kernel_profile_default.json && python3 benchmarks/bench_engine_gpu.py \
                            --contenders pagedserve --num-requests 512 --min-prompt 512 --max-prompt 2048 --output-len 64 \
                            --max-num-batched-tokens 16384 --kernel-profile --json $OUT/kernel_profile_prefill.json" ;;
        # Prefill-heavy (512 prompts of 512-2,048 tokens, 64 out), pagedserve alone, at two step budgets:
        # the FLOP utilisation against the 40% target, and whether bigger prefill steps raise it.
        prefill) step prefill 300 bash -c "for budget in 4096 16384; do python3 benchmarks/bench_engine_gpu.py \
                     --contenders pagedserve --num-requests 512 --min-prompt 512 --max-prompt 2048 --output-len 64 \
                     --max-num-batched-tokens \$budget --json $OUT/prefill_\$budget.json || exit 1; done" ;;
        # The default workload with q/k/v and gate/up merged (CUDA's default) and separate, side by side.
        merge) step merge 240 python3 benchmarks/bench_engine_gpu.py --contenders pagedserve,unmerged \
                   --json "$OUT/merge.json" ;;
        # Several GPUs: greedy output across ranks (NCCL), all-reduce ms per step.
        tp) step tp 420 python3 benchmarks/bench_tp_gpu.py --json "$OUT/tp.json" ;;
        # The default workload through HTTP (256 streams at once) against LLM.generate: served / offline
        # output tok/s, TTFT and ITL percentiles, ITL p99 / offline decode step, CPU per token by process.
        served) step served 540 python3 benchmarks/bench_served_gpu.py $QUICK --num-replicas "${SERVED_REPLICAS:-1,auto}" \
                    ${SERVED_EVENT_LOOP:+--event-loop "$SERVED_EVENT_LOOP"} --json "$OUT/served.json" ;;
        # Speculative decoding, llama-1b bf16: tok/s against the acceptance it gets (k = 4) at batch 1, 4
        # and 16, and a verification step's cost against a one-token step (the 1.3x target); the adaptive
        # rules at 256 sequences.
        spec) step spec 300 python3 benchmarks/bench_spec_decode.py --size 1b --device cuda --dtype bfloat16 \
                  --batches 1,4,16 --rounds 2 ;;
        # LoRA, llama-1b bf16: the decode step with 1, 8 and 32 adapters against the base model's (the
        # 1.3x target at 8), and an adapter's load against the base model's time to first token.
        lora) step lora 360 python3 benchmarks/bench_lora.py --size 1b --device cuda --dtype bfloat16 --load-rounds 3 --kernel-tokens 64 ;;
        profile) step profile 90 python3 benchmarks/bench_engine_gpu.py --contenders pagedserve --num-requests 128 \
                     --output-len 128 --profile "$OUT/profile_top.txt"
                 head -c 4000 "$OUT/profile_top.txt" ;;
        *) echo "unknown step $name" ;;
    esac
done
