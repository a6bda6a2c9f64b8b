#!/usr/bin/env bash
# What a session that is lent a GPU runs, in as few device calls as possible.
#
#   bash benchmarks/gpu_session.sh versions tests      # versions, graphs test, then the suite
#   bash benchmarks/gpu_session.sh kernels allreduce    # benchmarks (JSON under $OUT)
#   bash benchmarks/gpu_session.sh training report      # report: kernels.report --hardware
#   bash benchmarks/gpu_session.sh versions breakdown profile    # where the GPU time goes
#
# Stages (they run in the order named), and what each leaves under $OUT:
#   versions   GPU, driver and package versions                      versions.log
#   graphs     tests/test_graphs.py alone                            graphs.log
#   tests      graphs, then the whole suite without the simulator    graphs.log, tests.log
#   report     python -m kernels.report --hardware                   report.log
#   kernels, allreduce, training   the benchmarks                    NAME.log, NAME.json
#   multiworker  python -m benchmarks.multiworker: the ring across 2 and 4 processes (a core
#              each) vs MPI_Allreduce, the ConvNet with 1/2/4 workers  multiworker.log, .json
#   profile    Nsight Compute over python -m benchmarks.profile (the lab-shape conv, pooling,
#              softmax-xent and optimizer kernels, a few launches each, warm-up excluded):
#              profile.ncu-rep, profile-details.csv (the sections' values per kernel),
#              profile-raw.csv (every metric collected), profile.log (the run, then the
#              details page as text, with ncu's advice). No ncu, or no access to the counters
#              (ERR_NVGPUCTRPERM, or "LibraryNotLoaded" on gVisor): the log says so and the
#              same program runs alone with CUDA-event times per launch: profile-times.log,
#              profile.json
#   breakdown  python -m benchmarks.breakdown --device gpu: a ConvNet training step, part by
#              part (each layer's forward and backward, loss, all-reduce, optimizer), host
#              and CUDA-event GPU ms per step, beside PyTorch eager: breakdown.log, .json
#
# Every stage writes its log (and JSON, for benchmarks) under $OUT (default /tmp/gpu-out),
# with a time limit of its own so that one stuck stage cannot eat the whole call.
# Real CUDA only: NUMBA_ENABLE_CUDASIM=0 everywhere. The device tool brings back at most
# 8 files from $OUT (16 MiB each): name few stages per call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
export NUMBA_ENABLE_CUDASIM=0 MIRRORED_OFFLINE=1 MPLBACKEND=Agg PYTHONUNBUFFERED=1
# ptxas for kernels.report and the compile tests: a CUDA toolkit's, where no wheel brings one.
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
PY="${PYTHON:-python3}"
# Wheels carried to the machine in .whl/ (e.g. numpy<2.5, which numba-cuda 0.30 needs: numpy
# 2.5 removed np.row_stack, which numba-cuda's CUDA target imports on its first compile).
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Per-stage time limits (seconds); override with e.g. TESTS_S=300.
: "${TESTS_S:=330}" "${KERNELS_S:=200}" "${ALLREDUCE_S:=200}" "${TRAINING_S:=420}" "${XDIST:=12}"
: "${MULTIWORKER_S:=240}"
# breakdown + profile (+ its fallback) + versions fit in one 10-minute device command.
: "${PROFILE_S:=360}" "${PROFILE_TIMES_S:=120}" "${BREAKDOWN_S:=180}"
# Nsight Compute sections for the profile stage: is each kernel compute- or memory-bound,
# and on what (speed of light; memory and compute workload, with the per-level tables that
# show sectors per request, i.e. coalescing; launch, occupancy; warp stalls and scheduler
# issue; instruction mix; per-instruction source counters: branches, uncoalesced accesses).
: "${NCU_SECTIONS:=SpeedOfLight MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Tables ComputeWorkloadAnalysis LaunchStats Occupancy WarpStateStats SchedulerStats InstructionStats SourceCounters}"
# Files the device tool can bring back from $OUT: at most 16 MiB each.
MAX_FILE_BYTES=$((16 * 1024 * 1024))

stage() {  # stage NAME SECONDS CMD...: run with a limit, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}

find_ncu() {  # the Nsight Compute CLI: on PATH, in the CUDA toolkit, or the newest standalone
  command -v ncu 2>/dev/null && return 0
  [ -x /usr/local/cuda/bin/ncu ] && { echo /usr/local/cuda/bin/ncu; return 0; }
  ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -n 1 | grep . && return 0
  return 1
}

profile_times() {  # profile_times WHY: the fallback, the same program timed with CUDA events alone
  echo "profile: $1; running python -m benchmarks.profile with CUDA-event times only" | tee -a "$OUT/profile.log"
  stage profile-times "$PROFILE_TIMES_S" "$PY" -m benchmarks.profile --out "$OUT/profile.json" \
    ${PROFILE_ARGS:-} --launches "${PROFILE_TIMED_LAUNCHES:-20}"
}

profile() {  # ncu over benchmarks.profile's launches (cuProfilerStart/Stop ranges only)
  local ncu rep="$OUT/profile.ncu-rep" sections=() section f
  if ! ncu=$(find_ncu); then
    : > "$OUT/profile.log"
    profile_times "no ncu on PATH, in /usr/local/cuda/bin or /opt/nvidia/nsight-compute"
    return
  fi
  for section in $NCU_SECTIONS; do sections+=(--section "$section"); done
  rm -f "$rep"
  # --profile-from-start off: only the launches between the program's cuProfilerStart and
  # cuProfilerStop (no warm-up, no compile, no checks); --clock-control none: the card's
  # own clocks, which this machine must leave alone (ncu's default locks them to base).
  stage profile "$PROFILE_S" "$ncu" --target-processes all --profile-from-start off \
    --clock-control none ${sections[@]+"${sections[@]}"} --export "$OUT/profile" --force-overwrite \
    "$PY" -m benchmarks.profile --no-times ${PROFILE_ARGS:-}
  if grep -q -E "ERR_NVGPUCTRPERM|LibraryNotLoaded|Failed to initialize the profiler" "$OUT/profile.log"; then
    profile_times "ncu cannot read this GPU's performance counters (see profile.log)"
    return
  fi
  if [ ! -s "$rep" ]; then
    profile_times "ncu wrote no report (see profile.log)"
    return
  fi
  echo "=== profile: exporting $rep ($("$ncu" --version | tail -n 1))"
  timeout -k 5 120 "$ncu" --import "$rep" --page details --csv --print-units base \
    > "$OUT/profile-details.csv" 2>> "$OUT/profile.log"
  timeout -k 5 120 "$ncu" --import "$rep" --page raw --csv --print-units base \
    > "$OUT/profile-raw.csv" 2>> "$OUT/profile.log"
  { echo; echo "=== ncu --import profile.ncu-rep --page details"
    timeout -k 5 120 "$ncu" --import "$rep" --page details; } >> "$OUT/profile.log" 2>&1
  for f in "$rep" "$OUT/profile-raw.csv" "$OUT/profile.log"; do
    if [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt "$MAX_FILE_BYTES" ]; then
      gzip -f -9 "$f" && f="$f.gz"
      [ "$(stat -c %s "$f")" -gt "$MAX_FILE_BYTES" ] && echo "profile: $f is over 16 MiB and will not come back"
    fi
  done
  ls -l "$OUT"/profile*
}

for what in "$@"; do
  case "$what" in
    versions)
      { nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
        if ncu=$(find_ncu); then echo "ncu: $ncu, $("$ncu" --version | tail -n 1)"; else echo "ncu: not found"; fi
        "$PY" - <<'PYEOF'
import importlib.metadata as md, platform
for d in ("numpy", "numba", "numba-cuda", "llvmlite", "cuda-bindings", "cuda-core", "cuda-toolkit",
          "nvidia-cuda-nvcc-cu12", "nvidia-cuda-nvrtc", "cupy-cuda13x", "torch", "mpi4py", "h5py",
          "pytest", "pytest-xdist", "pytest-timeout", "nbclient", "hypothesis"):
    try:
        print(f"{d:22s} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"{d:22s} (not installed)")
print("python", platform.python_version())
from numba import cuda
print("numba.cuda.implementation:", getattr(cuda, "implementation", None))
print("cuda.is_available():", cuda.is_available())
cuda.detect()
print("driver:", cuda.cudadrv.driver.driver.get_version(), "runtime:", cuda.runtime.get_version())
PYEOF
      } > "$OUT/versions.log" 2>&1
      cat "$OUT/versions.log" ;;
    graphs)
      stage graphs 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_graphs.py ;;
    tests)
      stage graphs 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_graphs.py
      stage tests "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -n "$XDIST" --timeout "${TEST_TIMEOUT:-120}" -rfEs ;;
    report)
      stage report 240 "$PY" -m kernels.report --hardware ;;
    kernels)
      stage kernels "$KERNELS_S" "$PY" -m benchmarks.kernels --out "$OUT/kernels.json" ${KERNELS_ARGS:-} ;;
    allreduce)
      stage allreduce "$ALLREDUCE_S" "$PY" -m benchmarks.allreduce --out "$OUT/allreduce.json" ${ALLREDUCE_ARGS:-} ;;
    training)
      stage training "$TRAINING_S" "$PY" -m benchmarks.training --out "$OUT/training.json" ${TRAINING_ARGS:-} ;;
    multiworker)
      # the cross-process ring vs MPI_Allreduce with a core per process (this machine has
      # 16), and the lab ConvNet with 1/2/4 workers sharing the GPU (issue 17)
      stage multiworker "$MULTIWORKER_S" "$PY" -m benchmarks.multiworker --out "$OUT/multiworker.json" ${MULTIWORKER_ARGS:-} ;;
    profile)
      profile ;;
    breakdown)
      stage breakdown "$BREAKDOWN_S" "$PY" -m benchmarks.breakdown --device gpu \
        --out "$OUT/breakdown.json" ${BREAKDOWN_ARGS:-} ;;
    *) echo "unknown stage $what"; exit 2 ;;
  esac
done
