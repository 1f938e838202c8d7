#!/usr/bin/env bash
# Every GPU row of the benchmarks in one command, sized for at most 9 minutes on one GPU (issue 46), results under
# benchmarks/results/cuda/<gpu>/ (e.g. h200), each JSON with the commit of the tree that ran:
#   bench_gpu_share --mps                      what a GPU share caps (memory fraction, MPS percentage)
#   bench_lora_batch                           one UNet step of 8 rows, each its own LoRA, against none
#   bench_diffusion sd15-shape 512 px          ControlNet / LoRA / CFG rows, 20 steps
#   bench_diffusion sdxl-shape 1024 px         the same at SDXL's size, 20 steps
#   bench_trace                                GenTD26's busiest quarter hour: through Ray Serve when Ray imports,
#                                              else in-process (--in-process; its results say which)
# Each row runs under its own time limit; a row that fails or overruns is reported and the suite goes on.
#
# On a lent device machine (Python 3.12 with torch; nothing reachable): prepare the wheels here once
# (`bash benchmarks/gpu_wheels.sh`: .whl-parts/part-NN and COUNT), copy the two GenTD26 files into shared/traces/ of
# this checkout (they travel with it), then make one device call per part, back to back (the machine keeps /tmp
# only while warm, 30 s), each carrying [".whl-parts/part-NN", ".whl-parts/COUNT"] and running
# `bash benchmarks/gpu_suite.sh`: a call that completes the parts installs them and runs the suite; the others only
# keep their part. Unpack the archive the last call leaves in $OUT into benchmarks/results/cuda/<gpu>/. Where Ray
# cannot be installed, bench_trace runs in-process.
# Here, on CPU, a smoke of the suite itself (tiny sizes, seconds per row): SUITE_SMOKE=1 bash benchmarks/gpu_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -f .whl-parts/COUNT ] && [ -z "${SUITE_SMOKE:-}" ]; then  # wheels carried in parts, one per device call: keep them, install once all came
  mkdir -p /tmp/wheel-parts && cp .whl-parts/part-* /tmp/wheel-parts/
  have=$(ls /tmp/wheel-parts | wc -l); want=$(cat .whl-parts/COUNT)
  if [ "$have" -lt "$want" ]; then
    echo "== wheels: $have of $want parts here; run this again carrying the next part"
    exit 0
  fi
  mkdir -p /tmp/wheels && cat /tmp/wheel-parts/part-* | tar xf - -C /tmp/wheels || exit 1
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else 'cpu')")
if [ -n "${SUITE_SMOKE:-}" ]; then
  RESULTS=${SUITE_RESULTS:-$(mktemp -d)}
else
  RESULTS=${SUITE_RESULTS:-benchmarks/results/cuda/$gpu}
fi
TRACES=${SUITE_TRACES:-shared/traces}
[ -f "$TRACES/gentd26_lora_request_trace.csv" ] || TRACES=../shared/traces
mkdir -p "$RESULTS"
if [ -n "${SUITE_SMOKE:-}" ]; then
  SD15=(--preset tiny --size 64 --steps 2 --repeats 1); SDXL=(--preset sdxl-tiny --size 64 --steps 2 --repeats 1)
  LORA=(--preset tiny --size 64 --repeats 1 --ranks 4); SHARE=(); TRACE=(--max-requests 6 --repeats 1 --models 2)
  LIMITS=(300 300 300 300 600)
else
  SD15=(--size 512 --steps 20 --repeats 3 --lora-store-mb-per-s 100)
  SDXL=(--preset sdxl-shape --size 1024 --steps 20 --repeats 2 --lora-store-mb-per-s 100)
  LORA=(--repeats 20); SHARE=(--mps --seconds 3); TRACE=(--hours 0.25 --compression 20 --repeats 1)
  LIMITS=(60 60 120 150 120)  # seconds per row, in the order below: 8.5 minutes at most
fi
if $PY -c "import ray.serve" 2>/dev/null; then TRACE_MODE=(); else TRACE_MODE=(--in-process); fi

status=0
row() {  # row NAME LIMIT_S MODULE ARGS...: one benchmark under its own limit, its time and outcome printed
  local name=$1 limit=$2 module=$3; shift 3
  local started=$SECONDS
  echo "== $name: python -m $module $*"
  timeout "$limit" $PY -m "$module" "$@"
  local code=$?
  echo "== $name: exit $code after $((SECONDS - started)) s"
  [ $code -eq 0 ] || status=1
}
if [ -z "${SUITE_SMOKE:-}" ]; then
  row gpu_share "${LIMITS[0]}" benchmarks.bench_gpu_share "${SHARE[@]}" --out "$RESULTS"
fi
row lora_batch "${LIMITS[1]}" benchmarks.bench_lora_batch "${LORA[@]}" --out "$RESULTS"
row sd15 "${LIMITS[2]}" benchmarks.bench_diffusion "${SD15[@]}" --out "$RESULTS/sd15-512px"
row sdxl "${LIMITS[3]}" benchmarks.bench_diffusion "${SDXL[@]}" --out "$RESULTS/sdxl-1024px"
row trace "${LIMITS[4]}" benchmarks.bench_trace --trace "$TRACES/gentd26_lora_request_trace.csv" \
  --load-latencies "$TRACES/gentd26_lora_update_latency_anon.csv" "${TRACE[@]}" "${TRACE_MODE[@]}" --out "$RESULTS"
if [ -n "${OUT:-}" ]; then  # a device call brings back at most 8 files: one archive of them all
  tar czf "$OUT/gpu-suite-$gpu.tgz" -C "$RESULTS" . && echo "== archived to $OUT/gpu-suite-$gpu.tgz"
fi
echo "== suite: exit $status after $SECONDS s; results in $RESULTS"
exit $status
