#!/usr/bin/env bash
# What a session that is lent a GPU runs. Device time is 15 minutes per session in all
# (start-up, each call, idle waits; a call at most 10 minutes; the machine goes back after
# 30 s idle). So: plan 40 first, one device command of at most PLAN40_S (400 s, counted from
# the script's start: the wheels' install too), which leaves time for one rerun:
#
#   bash benchmarks/gpu_session.sh prepare   # HERE, not on the device, in the checkout that
#                                            # travels: the full MNIST and the wheels, ignored
#                                            # by git; prints the device call to make
#   bash benchmarks/gpu_session.sh 40        # ON THE DEVICE: issue 40's table, issue 41's GPU
#                                            # rows; carry .whl and .gpudata, timeout_s 415
#
# Plan 40, most important first (a stage that finds too little of the budget left is skipped,
# saying so; every stage's limit is cut to what is left):
#   versions.log      the GPU, driver, packages, numba's view of CUDA
#   course_lab.log, .json   benchmarks.course_lab --peer-epochs 3 --serial-cold: the course
#                     lab as written, 12 epochs of the full MNIST (.gpudata/mnist), three
#                     times, each a fresh process: cold with MIRRORED_COMPILE_AHEAD=0 (kernels
#                     compiled one by one at launch), cold (compiled ahead, several processes;
#                     each cold run a kernel cache and a CUDA driver cache of its own, empty)
#                     then warm (what cold wrote); test accuracy; per-cell and per-epoch
#                     seconds, compile seconds; PyTorch eager and CUDA-graph rows (3 epochs,
#                     their median) on the same images. Issue 40: warm <= 4 s, cold <= 7 s,
#                     steady ms/step <= 0.15, accuracy >= 98.5 %
#   host_profile.log, .json  benchmarks.host_profile --model conv --modes graph,eager: fit
#                     verbose=0 vs verbose=1 ms/step (issue 40: ratio <= 1.0) and cProfile
#                     of the host's functions, in the JSON
#   tests40.log       pytest on real CUDA, -n 7 (one worker per file), of the files whose
#                     gpu-marked or real-CUDA paths issues 40 and 41 left waiting for a card
#                     (TESTS40: steps_per_execution, lean_host, auto_resident, kernel_cache,
#                     kernel_disk_cache, function_replay, graphs, compile_ahead; issue 48's
#                     op kernels and ops, issue 50's threaded tf.function: kernels_tf_ops, ops,
#                     function_threads; issue 49's ring inside a forward and traced train_step:
#                     sync_batchnorm, custom_train_step)
#   custom_loop.log, .json  benchmarks.training --models convnet --rows custom --no-resident
#                     --epochs 3: fit eager and graph x1, the custom loop eager and under
#                     @function, PyTorch eager and CUDA graph (issue 41: @function / fit graph
#                     <= 1.2, @function / PyTorch eager <= 0.3)
#   then a summary of the figures above, printed last (the device call's output_tail)   8 files
# Budget: the stages end by 385 s (+ 10 s kill grace), the summary by 400 s; the call's
# timeout_s 415, so a call, a rerun of it and a start-up of a minute fit the 15 minutes
# (tests/test_gpu_session.py). Read the summary, then rerun at once (the machine stays warm
# 30 s) only what failed, or give the machine back.
# A rerun of some stages, each under its own limit (the *_S below): e.g.
# `bash benchmarks/gpu_session.sh tests40 custom_loop` (BUDGET_S=N caps them all together).
#
# Longer leases (the 30 minutes plans 1-3 were sized for; now one of them per session at most):
# three device commands, in order, each within 9 minutes (PLAN_S, 530 s, plus the kill grace):
#
#   bash benchmarks/gpu_session.sh 1    # versions; training rows; the step part by part
#   bash benchmarks/gpu_session.sh 2    # conv/pool kernels through graphs; launches; ncu
#   bash benchmarks/gpu_session.sh 3    # compute-sanitizer x3 on the kernel/graph/dropout
#                                       # tests; then the whole suite without the simulator
#
# Each command leaves at most 8 files under $OUT (what the device tool brings back):
#   1  versions.log; training.log, .json (benchmarks.training --models lab,convnet
#      --no-resident --epochs 5: the dense and ConvNet rows, eager (run_eagerly=True) and
#      graph (run_eagerly=False), x1, x2, x4 logical GPUs, PyTorch eager beside them); breakdown.log, .json (benchmarks.breakdown
#      --device gpu: a ConvNet step, each layer's forward and backward, loss, all-reduce,
#      optimizer); course_lab.log, .json (benchmarks.course_lab: the course lab as written,
#      12 epochs of the full MNIST from .gpudata/mnist, which `prepare` copies from
#      ../shared/data/mnist-full, carried; MNIST_FULL_DIR names another folder)  7 files
#   2  kernels.log, .json (benchmarks.kernels: every case it has, conv and pooling v1 beside
#      v3/fused where they exist, timed with CUDA events around captured graphs;
#      KERNELS_ARGS adds flags); launch.log, .json (benchmarks.launch with the real driver:
#      host µs per launch, numba's path vs the cached one); profile.ncu-rep,
#      profile-details.csv, profile-raw.csv, profile.log (Nsight Compute over
#      benchmarks.profile --only 'conv|pool'; where ncu is missing or refused:
#      profile.log, profile-times.log, profile.json, CUDA-event times alone)         8 files
#   3  sanitize-memcheck.log, sanitize-racecheck.log, sanitize-synccheck.log
#      (compute-sanitizer --tool T over pytest of the kernel tests that launch, the graph
#      and the dropout tests, real CUDA); tests.log (the suite, -n XDIST)            4 files
#
# compute-sanitizer: from NVIDIA's nvidia-cuda-sanitizer-api wheel carried in .whl/ (it
# unpacks under $SITE/nvidia/cu13/compute-sanitizer/), else SANITIZER=PATH, else the one on
# PATH or in /usr/local/cuda/bin; none: the logs say so. Exit 3 from a sanitize stage:
# the tool reported errors (--error-exitcode 3).
#
# The stages can also be named one by one (the plans are lists of them):
#   versions graphs tests report kernels allreduce training course_lab multiworker profile breakdown
#   launch sanitize host_profile tests40 custom_loop
#   graphs     tests/test_graphs.py alone                            graphs.log
#   report     python -m kernels.report --hardware                   report.log
#   allreduce  python -m benchmarks.allreduce                        allreduce.log, .json
#   multiworker  python -m benchmarks.multiworker: the ring across 2 and 4 processes vs
#              MPI_Allreduce, the ConvNet with 1/2/4 workers         multiworker.log, .json
#   profile    Nsight Compute over python -m benchmarks.profile ${PROFILE_ARGS} (the lab-shape
#              conv, pooling, softmax-xent and optimizer kernels, a few launches each,
#              warm-up excluded): profile.ncu-rep, profile-details.csv (the sections'
#              values per kernel), profile-raw.csv (every metric), profile.log (the run,
#              then the details page as text, with ncu's advice). No ncu, or no access to
#              the counters (ERR_NVGPUCTRPERM, or "LibraryNotLoaded" on gVisor): the log
#              says so and the same program runs with CUDA-event times per launch:
#              profile-times.log, profile.json
#
# Every stage runs under its own time limit, cut to what is left of the command's budget
# (BUDGET_S, PLAN_S for a plan), so one stuck stage cannot eat the lease. Real CUDA only:
# NUMBA_ENABLE_CUDASIM=0 everywhere. NUMBA_CACHE_DIR is one folder for every stage and
# command (the machine stays warm between the plan's commands): what numba caches on disk
# (the CPU loops, kernels/cpu_loops.py) is compiled once.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"        # the carried wheels' folder
MNIST_FILES="train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz"
# What the device's image lacks: numba-cuda, and a numpy it works with (the image's 2.5
# removed np.row_stack, which numba-cuda 0.30's CUDA target imports on its first compile).
# cp312: the image's python3 is 3.12.
: "${WHEEL_SPECS:=numpy==2.4.6 numba-cuda==0.30.4}"

prepare() {  # HERE, before the device call: the full MNIST and the wheels, in the checkout
  local src="${MNIST_SOURCE:-../shared/data/mnist-full}" dest="${MNIST_FULL_DIR:-.gpudata/mnist}"
  local exclude f spec need=""
  exclude=$(git rev-parse --git-path info/exclude) || { echo "prepare: $PWD is not a git checkout"; return 1; }
  mkdir -p "$(dirname "$exclude")"
  for f in /.gpudata/ /.whl/; do        # travel only when carried: never committed
    grep -qxF "$f" "$exclude" 2>/dev/null || echo "$f" >> "$exclude"
  done
  mkdir -p "$dest"
  for f in $MNIST_FILES; do
    [ -s "$dest/$f" ] && continue
    cp "$src/$f" "$dest/$f" || { echo "prepare: no $src/$f; MNIST_SOURCE=DIR names a folder with" \
                                      "the four MNIST .gz files"; return 1; }
  done
  mkdir -p "$WHEELS"
  for spec in $WHEEL_SPECS; do
    compgen -G "$WHEELS/$(echo "${spec%%==*}" | tr - _)-${spec##*==}-cp312-*.whl" > /dev/null || need="$need $spec"
  done
  if [ -n "$need" ]; then               # the device README's command: cp312, manylinux, no deps
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" $need || return 1
  fi
  echo "prepare: $dest: $(ls "$dest" | tr '\n' ' ')"
  echo "prepare: $WHEELS: $(ls "$WHEELS" | tr '\n' ' ')(one version of each: two stop the install)"
  echo "prepare: $(du -sh "$dest" "$WHEELS" | tr '\n\t' '  ')(the tree that travels: at most 64 MiB)"
  echo "prepare: now the device call: run(command=\"bash benchmarks/gpu_session.sh 40\"," \
       "carry=[\"$WHEELS\", \"${dest%%/*}\"], timeout_s=$((PLAN40 + 15)))"
}
if [ "${1:-}" = prepare ]; then
  PLAN40=${PLAN40_S:-400}
  prepare; exit $?
fi
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
export NUMBA_ENABLE_CUDASIM=0 MIRRORED_OFFLINE=1 MPLBACKEND=Agg PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-/tmp/mirrored-numba-cache}"
mkdir -p "$NUMBA_CACHE_DIR"
# ptxas for kernels.report and the compile tests: a CUDA toolkit's, where no wheel brings one.
# CUDA_BIN: the toolkit's bin folder (ptxas, ncu, compute-sanitizer), where the machine has one.
CUDA_BIN="${CUDA_BIN:-/usr/local/cuda/bin}"
[ -d "$CUDA_BIN" ] && export PATH="$PATH:$CUDA_BIN"
SITE="${SITE:-/tmp/site}"
# Wheels carried to the machine in .whl/ (e.g. numpy<2.5, which numba-cuda 0.30 needs: numpy
# 2.5 removed np.row_stack, which numba-cuda's CUDA target imports on its first compile; the
# sanitizer). Installed once per machine: later commands find the same set already there.
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  wheels="$(cd "$WHEELS" && ls *.whl | sort | tr '\n' ' ')"
  if [ "$(cat "$SITE/.carried" 2>/dev/null)" != "$wheels" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl || exit 1
    echo "$wheels" > "$SITE/.carried"
  fi
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
# Per-stage time limits (seconds); override with e.g. TESTS_S=300. A plan's limits add up
# to at most PLAN_S (tests/test_gpu_session.py checks it).
: "${PLAN_S:=530}" "${BUDGET_S:=100000}" "${PLAN40_S:=400}"
# Plan 40's limits (tests/test_gpu_session.py: with the summary's they add up to PLAN40_S).
# Expected on an H100 or H200, fresh machine: wheels 15 s, versions 10, course_lab 60-75 (three lab runs),
# host_profile 30, tests40 60-90, custom_loop 40, summary 1.
: "${VERSIONS40_S:=30}" "${COURSE_LAB40_S:=120}" "${HOST_PROFILE_S:=45}" "${TESTS40_S:=130}"
: "${CUSTOM_LOOP_S:=60}" "${SUMMARY40_S:=15}"
: "${COURSE_LAB_ARGS=--peer-epochs 3 --serial-cold}" "${HOST_PROFILE_ARGS=--model conv --modes graph,eager --epochs 3}"
: "${CUSTOM_LOOP_ARGS=--models convnet --rows custom --no-resident --epochs 3}"
# The test files issues 40 and 41 left waiting for a card: their gpu-marked tests, and the
# real-CUDA path of the rest (captured graphs, uploads, the kernel cache's loads)
: "${TESTS40=tests/test_steps_per_execution.py tests/test_lean_host.py tests/test_auto_resident.py tests/test_kernel_cache.py tests/test_kernel_disk_cache.py tests/test_function_replay.py tests/test_graphs.py tests/test_compile_ahead.py tests/test_kernels_tf_ops.py tests/test_ops.py tests/test_function_threads.py tests/test_sync_batchnorm.py tests/test_custom_train_step.py}"
: "${VERSIONS_S:=45}" "${TRAINING_S:=310}" "${COURSE_LAB_S:=90}" "${BREAKDOWN_S:=85}"
: "${KERNELS_S:=170}" "${LAUNCH_S:=60}" "${PROFILE_S:=180}" "${PROFILE_TIMES_S:=90}" "${EXPORT_S:=30}"
: "${MEMCHECK_S:=120}" "${RACECHECK_S:=110}" "${SYNCCHECK_S:=90}" "${TESTS_S:=200}" "${XDIST:=12}"
: "${ALLREDUCE_S:=200}" "${MULTIWORKER_S:=240}" "${GRAPHS_S:=120}" "${REPORT_S:=240}"
: "${TRAINING_ARGS=--models lab,convnet --no-resident --epochs 5}"   # fits TRAINING_S
# The tests compute-sanitizer runs (sanitize_tests): every kernel test that launches CUDA
# kernels (not test_kernels_compile.py, the compiler alone, nor test_kernels_cpu_loops.py),
# the graphs and the dropout layer; SANITIZE_TESTS="..." chooses others.
# Nsight Compute sections for the profile stage: is each kernel compute- or memory-bound,
# and on what (speed of light; memory and compute workload, with the per-level tables that
# show sectors per request, i.e. coalescing; launch, occupancy; warp stalls and scheduler
# issue; instruction mix; per-instruction source counters: branches, uncoalesced accesses).
: "${NCU_SECTIONS:=SpeedOfLight MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Tables ComputeWorkloadAnalysis LaunchStats Occupancy WarpStateStats SchedulerStats InstructionStats SourceCounters}"
# Files the device tool can bring back from $OUT: at most 16 MiB each.
MAX_FILE_BYTES=$((16 * 1024 * 1024))

left() {  # seconds left of this command's budget
  echo $((BUDGET_S - SECONDS))
}

stage() {  # stage NAME SECONDS CMD...: run with a limit, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  local rest; rest=$(left)
  if [ "$rest" -lt 15 ]; then
    echo "=== $name: skipped, ${rest}s left of the command's ${BUDGET_S}s" | tee "$OUT/$name.log"
    return
  fi
  [ "$limit" -gt "$rest" ] && limit=$rest
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}

find_ncu() {  # the Nsight Compute CLI: on PATH, in the CUDA toolkit, or the newest standalone
  command -v ncu 2>/dev/null && return 0
  [ -x "$CUDA_BIN/ncu" ] && { echo "$CUDA_BIN/ncu"; return 0; }
  ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -n 1 | grep . && return 0
  return 1
}

find_sanitizer() {  # compute-sanitizer: SANITIZER, the carried wheel's, PATH, the toolkit's
  local f
  for f in ${SANITIZER:-} "$SITE"/nvidia/cu*/compute-sanitizer/compute-sanitizer \
           "$SITE"/nvidia/cuda_sanitizer_api/compute-sanitizer/compute-sanitizer; do
    [ -f "$f" ] && { chmod +x "$f" 2>/dev/null; echo "$f"; return 0; }
  done
  command -v compute-sanitizer 2>/dev/null && return 0
  [ -x "$CUDA_BIN/compute-sanitizer" ] && { echo "$CUDA_BIN/compute-sanitizer"; return 0; }
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
    profile_times "no ncu on PATH, in $CUDA_BIN or /opt/nvidia/nsight-compute"
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
  timeout -k 5 "$EXPORT_S" "$ncu" --import "$rep" --page details --csv --print-units base \
    > "$OUT/profile-details.csv" 2>> "$OUT/profile.log"
  timeout -k 5 "$EXPORT_S" "$ncu" --import "$rep" --page raw --csv --print-units base \
    > "$OUT/profile-raw.csv" 2>> "$OUT/profile.log"
  { echo; echo "=== ncu --import profile.ncu-rep --page details"
    timeout -k 5 "$EXPORT_S" "$ncu" --import "$rep" --page details; } >> "$OUT/profile.log" 2>&1
  for f in "$rep" "$OUT/profile-raw.csv" "$OUT/profile.log"; do
    if [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt "$MAX_FILE_BYTES" ]; then
      gzip -f -9 "$f" && f="$f.gz"
      [ "$(stat -c %s "$f")" -gt "$MAX_FILE_BYTES" ] && echo "profile: $f is over 16 MiB and will not come back"
    fi
  done
  ls -l "$OUT"/profile*
}

sanitize_tests() {
  if [ -n "${SANITIZE_TESTS:-}" ]; then echo "$SANITIZE_TESTS"; return; fi
  ls tests/test_kernels_*.py | grep -v -e test_kernels_compile.py -e test_kernels_cpu_loops.py | tr '\n' ' '
  echo tests/test_graphs.py tests/test_dropout_layer.py
}

sanitize() {  # compute-sanitizer's memcheck, racecheck and synccheck over sanitize_tests
  local san tool limit tests
  if ! san=$(find_sanitizer); then
    for tool in memcheck racecheck synccheck; do
      echo "sanitize: no compute-sanitizer (carry NVIDIA's nvidia-cuda-sanitizer-api wheel in .whl/," \
           "or set SANITIZER=PATH); $tool not run" | tee "$OUT/sanitize-$tool.log"
    done
    return
  fi
  echo "=== sanitize: $san ($("$san" --version 2>&1 | tail -n 1))"
  tests=$(sanitize_tests)
  for tool in memcheck racecheck synccheck; do
    case $tool in memcheck) limit=$MEMCHECK_S ;; racecheck) limit=$RACECHECK_S ;; *) limit=$SYNCCHECK_S ;; esac
    # One pytest process (no xdist): the tool follows it and numba's compiles; every kernel
    # launch is checked. --error-exitcode 3: the stage's exit says the tool found errors.
    stage "sanitize-$tool" "$limit" "$san" --tool "$tool" --target-processes all --error-exitcode 3 \
      --print-limit 50 "$PY" -m pytest -q -p no:cacheprovider -rfEs $tests
  done
}

mnist_check() {  # without the full MNIST the lab runs on the bundled 8,000 images: say so first
  local dir="${MNIST_FULL_DIR:-.gpudata/mnist}" f
  for f in $MNIST_FILES; do
    if [ ! -s "$dir/$f" ]; then
      echo "=== course_lab: WARNING: no $dir/$f, so the lab runs on the bundled 8,000-image subset," \
           "not issue 40's full MNIST (bash benchmarks/gpu_session.sh prepare; carry .gpudata)"
      return
    fi
  done
}

summary40() {  # plan 40's figures, printed last: what the device call's output_tail shows
  echo "=== plan 40: summary, ${SECONDS}s after the start"
  [ -f "$OUT/tests40.log" ] && echo "tests40: $(tail -n 1 "$OUT/tests40.log")"
  timeout -k 2 $((SUMMARY40_S - 2)) "$PY" - "$OUT" <<'PYEOF'
import json, math, os, statistics, sys

def load(name):
    try:
        with open(os.path.join(sys.argv[1], name)) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        print(f"{name}: none ({type(err).__name__})")

def section(name, show):
    doc = load(name)
    try:
        doc and show(doc)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        print(f"{name}: unreadable ({type(err).__name__}: {err})")

def lab(doc):      # issue 40: warm <= 4 s, cold <= 7 s, steady <= 0.15 ms/step, accuracy >= 98.5 %
    for name, r in doc["runs"].items():
        e, steps = r["epochs_s"], math.ceil(r["train_examples"] / (64 * r["replicas"]))
        steady = statistics.median(e[2:]) / steps * 1e3 if len(e) > 2 else float("nan")
        c = r["compile_s"]
        print(f"course_lab {name}: wall {r['wall_s']:.2f} s, fit {r['fit_s']:.2f} s, epoch 1 {e[0]:.2f} s, "
              f"steady {steady:.3f} ms/step, accuracy {r['test_accuracy']:.4f}, {c['cuda_compiles']} "
              f"kernels compiled in {c['cuda_kernels']:.2f} s ({r['source']}, {r['train_examples']} images)")
        for a in r.get("compile_ahead", [])[:1]:    # fit's first step: kernels/compile_ahead.py
            print(f"course_lab {name}: compiled ahead: {a.get('missing')} of {a.get('planned')} launches "
                  f"missing, {a.get('children')} children + {a.get('here')} here, "
                  f"{a.get('seconds', 0):.2f} s, errors {a.get('errors', a.get('error'))}")
    for p in doc["peers"]:
        print(f"course_lab {p['row']}: {p['ms_per_step']:.3f} ms/step")
    for s in doc["skipped"]:
        print(f"course_lab skipped {s['name']}: {s['reason']}")

def host(doc):     # issue 40: verbose=0 / verbose=1 <= 1.0
    for mode, m in doc["modes"].items():
        print(f"host_profile {doc['model']} {mode}: verbose=0 {m['verbose0_ms_per_step']:.3f}, "
              f"verbose=1 {m['verbose1_ms_per_step']:.3f} ms/step, ratio {m['quiet_over_loud']:.2f}")

def custom(doc):   # issue 41: custom loop @function / fit graph <= 1.2, / PyTorch eager <= 0.3
    for r in doc["results"]:
        print(f"custom_loop {r['row']}: {r['ms_per_step']:.3f} ms/step")
    for r in doc["ratios"]:
        print(f"custom_loop ratio {r['ratio']}: {r['value']:.2f}")
    for t in doc["targets"]:
        print(f"custom_loop target {t['target']}: {t['measured']:.2f} "
              f"({t['want']} {t['threshold']}: {'met' if t['met'] else 'NOT met'})")
    for s in doc["skipped"]:
        print(f"custom_loop skipped {s['name']}: {s['reason']}")

section("course_lab.json", lab)
section("host_profile.json", host)
section("custom_loop.json", custom)
PYEOF
}

versions() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
    if ncu=$(find_ncu); then echo "ncu: $ncu, $("$ncu" --version | tail -n 1)"; else echo "ncu: not found"; fi
    if san=$(find_sanitizer); then echo "compute-sanitizer: $san, $("$san" --version 2>&1 | tail -n 1)"
    else echo "compute-sanitizer: not found"; fi
    echo "NUMBA_CACHE_DIR: $NUMBA_CACHE_DIR"
    echo "=== versions (limit ${VERSIONS_S}s): $PY -" >&3
    timeout -k 5 "$VERSIONS_S" "$PY" - <<'PYEOF'
import importlib.metadata as md, platform
for d in ("numpy", "numba", "numba-cuda", "llvmlite", "cuda-bindings", "cuda-core", "cuda-toolkit",
          "nvidia-cuda-nvcc-cu12", "nvidia-cuda-nvrtc", "nvidia-cuda-sanitizer-api", "cupy-cuda13x",
          "torch", "mpi4py", "h5py", "pytest", "pytest-xdist", "pytest-timeout", "nbclient", "hypothesis"):
    try:
        print(f"{d:26s} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"{d:26s} (not installed)")
print("python", platform.python_version())
from numba import cuda
print("numba.cuda.implementation:", getattr(cuda, "implementation", None))
print("cuda.is_available():", cuda.is_available())
cuda.detect()
print("driver:", cuda.cudadrv.driver.driver.get_version(), "runtime:", cuda.runtime.get_version())
PYEOF
  } 3>&1 > "$OUT/versions.log" 2>&1
  cat "$OUT/versions.log"
}

run_stage() {
  case "$1" in
    versions) versions ;;
    graphs)
      stage graphs "$GRAPHS_S" "$PY" -m pytest -q -p no:cacheprovider tests/test_graphs.py ;;
    tests)
      # The multi-worker tests' mpiexec: the machine's Open MPI refuses root unless told
      # (the GPU machines run commands as root); mpich's ignores these. The compile tests
      # build every kernel with ptxas in their fixture: minutes on 12 busy workers.
      OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        stage tests "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -n "$XDIST" --timeout "${TEST_TIMEOUT:-300}" -rfEs ;;
    report)
      stage report "$REPORT_S" "$PY" -m kernels.report --hardware ;;
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
    course_lab)
      # its cold run gets a kernel cache (and a CUDA driver cache) of its own, empty; the
      # warm run the same folders: benchmarks/course_lab.py's cold_and_warm
      mnist_check
      stage course_lab "$COURSE_LAB_S" "$PY" -m benchmarks.course_lab \
        --data-dir "${MNIST_FULL_DIR:-.gpudata/mnist}" --out "$OUT/course_lab.json" ${COURSE_LAB_ARGS:-} ;;
    host_profile)
      stage host_profile "$HOST_PROFILE_S" "$PY" -m benchmarks.host_profile --json "$OUT/host_profile.json" \
        ${HOST_PROFILE_ARGS:-} ;;
    tests40)
      # -n 7, one worker per file (--dist loadfile): compiles run side by side on the 16
      # cores; conftest's -n auto would give one worker on a GPU. -v: a stage killed at its
      # limit still shows which tests passed. --timeout where pytest-timeout is installed.
      local per_test=()
      "$PY" -c "import pytest_timeout" 2> /dev/null && per_test=(--timeout "${TEST_TIMEOUT:-120}")
      stage tests40 "$TESTS40_S" "$PY" -m pytest -v -p no:cacheprovider -n "${XDIST40:-7}" --dist loadfile \
        ${per_test[@]+"${per_test[@]}"} -rfEs $TESTS40 ;;
    custom_loop)
      stage custom_loop "$CUSTOM_LOOP_S" "$PY" -m benchmarks.training --out "$OUT/custom_loop.json" \
        ${CUSTOM_LOOP_ARGS:-} ;;
    breakdown)
      stage breakdown "$BREAKDOWN_S" "$PY" -m benchmarks.breakdown --device gpu \
        --out "$OUT/breakdown.json" ${BREAKDOWN_ARGS:-} ;;
    launch)
      stage launch "$LAUNCH_S" "$PY" -m benchmarks.launch --out "$OUT/launch.json" ${LAUNCH_ARGS:-} ;;
    sanitize)
      sanitize ;;
    *) echo "unknown stage $1 (the plans: 40, 1, 2, 3; prepare; stages: see the header)"; exit 2 ;;
  esac
}

if [ $# -eq 0 ]; then
  echo "usage: bash benchmarks/gpu_session.sh prepare (here), 40|1|2|3, or stage names (see the header)"; exit 2
fi
for what in "$@"; do
  case "$what" in
    40)
      # from the script's start (the wheels' install counts), less the summary's own seconds
      BUDGET_S=$((PLAN40_S - SUMMARY40_S))
      VERSIONS_S=$VERSIONS40_S COURSE_LAB_S=$COURSE_LAB40_S
      echo "=== plan 40: at most ${PLAN40_S}s from the start, $((PLAN40_S - SECONDS))s left"
      for s in versions course_lab host_profile tests40 custom_loop; do run_stage "$s"; done
      summary40 ;;
    1|2|3)
      BUDGET_S=$((SECONDS + PLAN_S))
      echo "=== plan $what: at most ${PLAN_S}s"
      case "$what" in
        1) stages="versions training course_lab breakdown" ;;
        2) stages="kernels launch profile"; : "${PROFILE_ARGS=--only conv|pool}" ;;
        3) stages="sanitize tests" ;;
      esac
      for s in $stages; do run_stage "$s"; done ;;
    *) run_stage "$what" ;;
  esac
done
