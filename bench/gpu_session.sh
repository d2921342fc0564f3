#!/usr/bin/env bash
# Every GPU measurement bench/RESULTS.md records, in one device session.
#
# Why one script: a GPU machine is lent for minutes at a time and each start
# costs one; the steps below share its warm-up. Each step has its own time
# limit, so one that hangs cannot take the later ones with it, and results
# are packed after every step, so a cut-off run still returns what finished.
#
#   bash bench/gpu_session.sh OUTDIR [STEPS]     STEPS: comma list, default all
#
# Run it from the repository root: each step runs a bench script as `python3 -m bench.NAME`.
#
# Needs torch with CUDA and Triton. Packages the machine lacks (nixl,
# nixl-cu13, pyzmq, msgspec, xxhash, prometheus_client, wrapt, orjson, pyyaml, rich
# and its two dependencies) are installed from ./.whl when that folder
# exists; fill it on a machine with an index, for the GPU machine's Python:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .whl NAME==VERSION
# with the versions of requirements/constraints.txt.
# Environment: RIG_VARIANTS (probe configs beside "off"), SERVING_REPS (pairs of the
# servinggpu leg, default 7), LONG_REPS (of servinglong and servingdeploy, default 5),
# HOOK_CALLS (timed calls per hook kind in hookcost, default 2000; HOOK_COLD_CALLS in hookcostcold,
# default 1000), DIGEST_SWEEP (see digest).
set -u
out=${1:?usage: bench/gpu_session.sh OUTDIR [STEPS]}
steps=${2:-audit,auditdiag,inject,costs,coldcalls,hookcost,hookcostcold,hostpool,hicachesync,hicacheserving,hicacheservingprod,profile,serving,servingspin,servinggpu,servinglong,servingdeploy,serving8,overhead,rig}
mkdir -p "$out"
res=$(mktemp -d)
export PYTHONUNBUFFERED=1
log="$out/session.log"

if [ -d .whl ]; then
    site="$res/site"  # installed packages; the packed results leave it out
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "wheel install failed" | tee -a "$log"; exit 1; }
    export PYTHONPATH=$site:$PWD
fi
{ date -u; nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } 2>&1 | tee -a "$log"

step() {  # name, time limit (s), command...
    local name=$1 limit=$2
    shift 2
    case ",$steps," in *",$name,"*) ;; *) return 0 ;; esac
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
    local started=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "=== $name exit ${PIPESTATUS[0]} after $((SECONDS - started)) s" | tee -a "$log"
    tar -czf "$out/results.tgz" --exclude=./site -C "$res" . 2>/dev/null
}

step audit 45 python3 -m bench.sync_audit --out "$res/sync_audit"
# With diagnosis on (the default; `audit` runs verification alone): its journal, snapshots and page-id copies too.
step auditdiag 45 python3 -m bench.sync_audit --diagnosis --out "$res/sync_audit_diagnosis"
step inject 25 python3 -m bench.sync_audit --inject-sync pd --rooms 8 --out "$res/sync_audit_injected"
step costs 60 python3 -m bench.launch_costs --nixl --out "$res/launch_costs"
# What each device call costs right after a 10 ms forward, and after 0.2 ms: the floor under a hook call.
step coldcalls 60 bash -c "python3 -m bench.cold_calls --calls 300 --out '$res/cold_calls_10ms' && python3 -m bench.cold_calls --calls 300 --gap-ms 0.2 --out '$res/cold_calls_02ms'"
# Serving-thread CPU per hook call (real launches, a 0.2 ms GPU kernel waited on before each call).
step hookcost 240 python3 -m bench.hook_cost --real-launch --gap-wait gpu --calls "${HOOK_CALLS:-2000}" --out "$res/hook_cost"
# The same, one call per 10 ms forward (the rig's shape: a stress-leg batch carries ~0.85 calls):
# a call right after a forward costs more than one 0.2 ms after the last (docs/overhead.md).
step hookcostcold 240 python3 -m bench.hook_cost --real-launch --gap-wait gpu --gap-ms 10 --calls "${HOOK_COLD_CALLS:-1000}" \
    --out "$res/hook_cost_cold"
# Prefill's send as its hook makes it now (the token indices as they are) and before (divided into
# page ids first), three interleaved rounds of 1,000 calls each.
step hooksend 300 bash -c "for round in 1 2 3; do for table in divided tokens; do \
    python3 -m bench.hook_cost --real-launch --gap-wait gpu --calls 1000 --kinds send --send-table \$table \
    --out $res/hook_send_\${table}_\$round || exit 1; done; done"
# HiCache host-pool copies with restore verification (the default), without it, and round
# trip: cycles/s against the bare pool; then the wrappers' CPU per call under sync-debug "error".
step hostpool 300 python3 -m bench.overhead --device cuda --skip-rig --reps 7 --out "$res/overhead_hostpool"
step hicachesync 180 python3 -m bench.hicache_overhead --device cuda --standalone
# Where restore verification's time goes on the copying thread: wall and thread CPU with its
# collector running and held, and a cProfile of the copying thread (not in the default list).
step hicacheprofile 150 python3 -m bench.hicache_profile --device cuda --calls 800 --rounds 5
# HiCache restore verification inside serving-shaped traffic (one write-through backup per
# room, half the rooms restore a prefix, 10 ms GPU model steps): rooms/s on/off, 7 pairs.
step hicacheserving 240 python3 -m bench.hicache_serving --device cuda --reps 7 --target-seconds 2 --step-ms 10 \
    --out "$res/hicache_serving"
# The same at a production prefill rate: 111 ms a step for its 2 x 4,096 tokens (DeepSeek's published
# 73.7k input tokens/s per 8-GPU prefill node, one scheduler per node; docs/hicache.md).
step hicacheservingprod 200 python3 -m bench.hicache_serving --device cuda --reps 7 --target-seconds 4 --step-ms 111 \
    --out "$res/hicache_serving_prod"
# The same with the restore collectors' deferral off (hicache.restore_defer_ms 0; not in the default list).
step hicacheservingnodefer 240 python3 -m bench.hicache_serving --device cuda --reps 7 --target-seconds 2 --step-ms 10 \
    --restore-defer-ms 0 --out "$res/hicache_serving_nodefer"
# The submit's parts with the engine's two output places (digest.outputs), one after the other.
step profile 150 bash -c "python3 -m bench.submit_profile --calls 200 --out $res/profile && \
    python3 -m bench.submit_profile --calls 200 --outputs pinned --out $res/profile_pinned"
step serving 240 python3 -m bench.overhead --device cuda --reps 7 --target-seconds 2 --decode-step-ms 10 \
    --step-interval 64 --skip-hostpool --profile-runs --out "$res/overhead_serving"
step servingspin 240 python3 -m bench.overhead --device cuda --reps 7 --target-seconds 2 --decode-step-ms 10 \
    --decode-step-wait spin --step-interval 64 --skip-hostpool --out "$res/overhead_serving_spin"
# Prefill and decode on GPUs of their own where the machine has two, as deployed.
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 1)
two_gpus="--prefill-gpu 0 --decode-gpu $(( gpus > 1 ? 1 : 0 ))"
# A GPU-kernel model step needs decode's GPU to itself: on one GPU, prefill's
# process waits its time slice behind each 10 ms kernel and the rig starves
# (7 rooms/s, 2 running, 14:29 UTC entry). One GPU: the step sleeps instead.
gpu_wait=$([ "$gpus" -gt 1 ] && echo gpu || echo sleep)
echo "model step for servinggpu / servinglong: $gpu_wait ($gpus GPU)" | tee -a "$log"
# These legs also run the collector's other way of waiting ("observe-poll"),
# unless RIG_VARIANTS names others. "observe" runs the defaults (diagnosis on);
# RIG_VARIANTS=off,observe-nodiag,observe-diag shows what diagnosis adds (docs/diagnosis.md).
variants="--rig-variants ${RIG_VARIANTS:-off,observe,observe-poll}"
# Runs per rep (one per variant): the long legs' time limits scale with them (measured
# 2026-12-02 on one H200: a servinglong run takes ~15 s, a servingdeploy run ~30 s).
runs=$(( $(tr -cd , <<< "${RIG_VARIANTS:-off,observe,observe-poll}" | wc -c) + 1 ))
step servinggpu 330 python3 -m bench.overhead --device cuda --reps "${SERVING_REPS:-7}" --target-seconds 2 --decode-step-ms 10 \
    --decode-step-wait $gpu_wait $two_gpus --step-interval 64 --skip-hostpool $variants --profile-runs --out "$res/overhead_serving_gpu"
# Rooms that live 100-300 decode steps (a receipt and a finish every ~6 batches,
# still several times the churn of a real decode instance), 32 running.
step servinglong $(( 60 + 18 * runs * ${LONG_REPS:-5} )) python3 -m bench.overhead --device cuda --reps "${LONG_REPS:-5}" --target-seconds 6 --warmup-frac 0.25 \
    --decode-step-ms 10 --decode-step-wait $gpu_wait --min-steps 100 --max-steps 300 --max-running 32 $two_gpus \
    --step-interval 64 --skip-hostpool $variants --out "$res/overhead_serving_long"
# Model time closer to a DeepSeek-V4 decode instance at serving batch sizes (30 ms per
# step; large-EP decode steps take tens of ms), the long leg's churn otherwise.
step servingdeploy $(( 60 + 35 * runs * ${LONG_REPS:-5} )) python3 -m bench.overhead --device cuda --reps "${LONG_REPS:-5}" --target-seconds 12 --warmup-frac 0.25 \
    --decode-step-ms 30 --decode-step-wait $gpu_wait --min-steps 100 --max-steps 300 --max-running 32 $two_gpus \
    --step-interval 64 --skip-hostpool $variants --out "$res/overhead_serving_deploy"
step serving2 240 python3 -m bench.overhead --device cuda --reps 5 --target-seconds 2 --decode-step-ms 10 \
    $two_gpus --step-interval 64 --skip-hostpool --out "$res/overhead_serving_2gpu_sleep"
step serving8 180 python3 -m bench.overhead --device cuda --reps 5 --target-seconds 2 --decode-step-ms 10 \
    --step-interval 8 --skip-hostpool --out "$res/overhead_serving8"
step overhead 150 python3 -m bench.overhead --device cuda --reps 5 --target-seconds 1.5 --out "$res/overhead"
step rig 60 python3 -m bench.rig_gpu --rooms 200
# The digest kernel: Triton's cache filled by 16 processes first, then exactness, the
# same-run ceilings and the sweep (bench/digest_gpu.py); then Nsight Compute on the
# fp8 default tuning (step digestncu, not in the default list).
# DIGEST_SWEEP (rows x warps, comma list) narrows the large room's sweep (all by default).
step digest 420 bash -c "python3 -m bench.digest_gpu --precompile-only && python3 -m bench.digest_gpu \
    ${DIGEST_SWEEP:+--sweep $DIGEST_SWEEP} --out $res/digest"
# The digest engine's tests on the GPU: the CUDA paths the interpreter cannot take (not in the default list).
step gputests 240 python3 -m pytest -q -p no:cacheprovider tests/digest
# Where a gathered read loses to a contiguous one (bench/read_patterns.py; not in the default list).
step patterns 420 python3 -m bench.read_patterns --out "$res/read_patterns"
step digestncu 150 bash -c "ncu --clock-control none -k regex:_digest_rooms_kernel --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
    python3 -m bench.digest_gpu --profile-one fp8 --shapes 1x1,1x4 > $res/digest_ncu.txt 2>&1; tail -80 $res/digest_ncu.txt"
tar -czf "$out/results.tgz" --exclude=./site -C "$res" .
