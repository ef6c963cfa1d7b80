#!/usr/bin/env bash
# The checks a lent GPU machine runs, in one go, most important first; each step has its own
# time limit so that one hang cannot eat the rest. Logs go to $OUT (or ./gpu-logs).
#
#   [STEPS="engine host tests kernel_tests ..."] bash benchmarks/gpu_checks.sh [--quick]
#
# One device call runs at most 600 s, and a session's device time (15 minutes, the machine's
# start included) fits about one full call and a short one, most important first:
#   STEPS="engine host tests" (at most 290 + 150 + 300 s; on an H200 254 + 49 + 205 s), then on
#   the warm machine STEPS="prefill" (102 s) or "kernel_tests" (151 s).
# Where the targets are missed, STEPS="kernel_profile kernel_tiles" shows where the
# device time goes, and whether other attention tiles beat the defaults. The rest ("launches kernels sweep merge") in a later session.
# Next (as of 2026-11-29), in two calls (the recipe below): STEPS="host kernel_profile" while Ray's
# first part crosses (host first, on a fresh machine: its step at 256 sequences was 2.25 ms on
# 2026-11-29 against 1.42 ms on 2026-11-28; the profile runs also print each kind of step's device
# time), then STEPS="served" (one ingress replica beside the default, two per GPU worker since
# 2026-11-29's run found one replica's core saturated at 25k tok/s). In a later session:
# STEPS="kernel_tiles", then "engine", then "tests spec lora" (the verification steps' and LoRA's
# decode steps' CUDA graphs, never captured on a GPU yet: test_cuda_greedy's speculation tests and
# test_lora's CUDA test; then the verification cost against a one-token step and LoRA's step cost
# on the GPU). "kernel_tests" passed on an H200 on 2026-11-29 (540 tests).
#
# "tp" is for a machine with several GPUs (it says so and passes on one).
#
# "served" (benchmarks/bench_served_gpu.py) streams the default workload through `pagedserve serve`
# over HTTP against LLM.generate in the same call, and reads every server process's CPU per token
# and the engine's decode step while served. On an H200 the offline part takes about 55 s and each
# served run about 145 s (the server's start most of it).
# It needs Ray on the machine. Ray's wheel (cp312, manylinux2014 x86_64, about 79 MB) is over one
# call's 64 MiB, so it travels in two parts in two calls on the warm machine. A warm machine keeps
# /tmp between calls but not the ignored files that a call does not carry, so the first call copies
# its part to /tmp and the second copies it back. `bash benchmarks/gpu_wheels.sh` (here, with a
# package registry) lays out .whl/: Ray's two parts and their sha256 in .whl/parts/, the other
# wheels the machine lacks in two halves, .whl/deps1 and .whl/deps2. Then:
#   call 1: carry .whl/parts/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl.part-aa, its .sha256 and
#           .whl/deps1; command:
#           mkdir -p /tmp/rayparts && cp .whl/parts/* /tmp/rayparts/ && STEPS="host kernel_profile" bash benchmarks/gpu_checks.sh
#   call 2: carry .whl/parts/ray-...-.whl.part-ab and .whl/deps2; command:
#           cp /tmp/rayparts/* .whl/parts/ && STEPS="served" bash benchmarks/gpu_checks.sh
# This script joins the parts once they are all there (the .sha256 says so), then installs every
# wheel in .whl/ and one folder down.

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

# A wheel carried in parts over two calls is joined once its parts are all there: its NAME.sha256
# (`sha256sum` of the whole wheel, named .whl/NAME) travels with the first part.
for first in .whl/parts/*.part-aa; do
    [ -e "$first" ] || continue
    name=$(basename "${first%.part-aa}")
    cat ".whl/parts/$name".part-* > ".whl/$name"
    if [ -f ".whl/parts/$name.sha256" ] && ! sha256sum --quiet -c ".whl/parts/$name.sha256"; then
        echo "$name: parts incomplete, not installed"
        rm -f ".whl/$name"
    fi
done
if [ -d .whl ]; then   # wheels in .whl/ and one folder down (a call's share of them)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $(find .whl -maxdepth 2 -type f -name '*.whl' -not -path '.whl/site/*')
    [ -d .whl/site ] && cp -r .whl/site/. /tmp/site/
fi
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
        served) step served 480 python3 benchmarks/bench_served_gpu.py $QUICK --num-replicas 1,auto --json "$OUT/served.json" ;;
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
