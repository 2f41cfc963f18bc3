#!/usr/bin/env bash
# The GPU checks in one call, for a lent GPU machine (docs/gpu.md): its image has CUDA torch,
# cupy, numpy, pytest, pytest-timeout and psutil but no MPI and no network, so MPICH and mpi4py
# travel as wheels in .whl/ (scripts/gpu_wheels.sh fetches them here; the device tool carries
# .whl). Runs `pytest -m gpu` and the GPU benchmarks (gpu_allreduce.py, gpu_train.py); every log
# lands in $OUT (or ./gpu-out).
#
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# GPU_BASELINE=<tree> also benchmarks another revision, alternated with this one; GPU_CPU_BENCH=1
# adds the CPU benchmarks (latency, MLP training) on that machine's cores; GPU_PROFILE=1 profiles
# gpu_train.py's device-bucket steps. GPU_TESTS=<pytest -k expression> runs only those GPU tests;
# GPU_BENCH=0 skips the GPU benchmarks (a short check of one change: less device time).
# GPU_CPU_BENCH also runs overlap.py and allreduce.py (issue 17's figures with a core per engine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  "$PY" -c "import cupy; print('cupy', cupy.__version__, 'gpus', cupy.cuda.runtime.getDeviceCount())" || echo "no cupy"
} 2>&1 | tee "$OUT/env.txt"

# MPICH from its wheel: bin/ (mpiexec) and lib/ (libmpi) unpacked into a prefix of its own
# (pip --target drops a wheel's data files), mpi4py pointed at that libmpi.
if ls .whl/mpich-*.whl >/dev/null 2>&1; then
  "$PY" - <<'PY'
import glob, os, shutil, stat, zipfile
whl = sorted(glob.glob(".whl/mpich-*.whl"))[-1]
prefix = "/tmp/mpich"
shutil.rmtree(prefix, ignore_errors=True)
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        parts = info.filename.split("/")
        if len(parts) > 3 and parts[0].endswith(".data") and parts[1] == "data" and not info.is_dir():
            target = os.path.join(prefix, *parts[2:])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(target, mode or (0o755 if parts[2] == "bin" else 0o644))
for link, real in (("libmpi.so", "libmpi.so.12"), ("libmpi_abi.so", "libmpi_abi.so.1")):
    path = os.path.join(prefix, "lib", link)
    if os.path.getsize(path) < 64:  # the wheel stores the symlink as a file holding its target
        os.remove(path)
        os.symlink(real, path)
print("mpich unpacked into", prefix)
PY
  export PATH=/tmp/mpich/bin:$PATH LD_LIBRARY_PATH=/tmp/mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export MPI4PY_LIBMPI=/tmp/mpich/lib/libmpi.so.12
fi
if ls .whl/mpi4py-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/mpi4py-*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export IPYTHONDIR=/tmp/ipython JUPYTER_RUNTIME_DIR=/tmp/jupyter-runtime
"$PY" -c "from mpi4py import MPI; print('mpi4py', MPI.Get_library_version().splitlines()[0])" 2>&1 | tee -a "$OUT/env.txt"

echo "== pytest -m gpu" | tee "$OUT/gpu-tests.txt"
timeout 330 "$PY" -m pytest -m gpu ${GPU_TESTS:+-k "$GPU_TESTS"} -v -rs -p no:cacheprovider \
  tests/test_torch.py tests/test_cupy.py 2>&1 | tee -a "$OUT/gpu-tests.txt"
if [ "${GPU_BENCH:-1}" != 0 ]; then
  echo "== benchmarks/gpu_allreduce.py" | tee "$OUT/gpu-bench.txt"
  if [ -n "${GPU_BASELINE:-}" ]; then
    # another revision's tree (e.g. `git archive main | tar -x -C .gpubase`, carried): both run on
    # this machine, alternated twice, so their figures compare
    for round in 1 2; do
      for tree in "$PWD" "$GPU_BASELINE"; do
        echo "== tree $tree (round $round)" | tee -a "$OUT/gpu-bench.txt"
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 150 "$PY" benchmarks/gpu_allreduce.py) 2>&1 | tee -a "$OUT/gpu-bench.txt"
      done
    done
  else
    timeout 150 "$PY" benchmarks/gpu_allreduce.py 2>&1 | tee -a "$OUT/gpu-bench.txt"
  fi
  echo "== benchmarks/gpu_train.py" | tee "$OUT/gpu-train.txt"
  timeout 150 "$PY" benchmarks/gpu_train.py ${GPU_PROFILE:+--profile} 2>&1 | tee -a "$OUT/gpu-train.txt"
fi
if [ -n "${GPU_CPU_BENCH:-}" ]; then
  # the machine's CPUs (many cores, unlike CI's 2): small-message latency and the MLP's efficiency
  # when the engine thread has a core of its own
  echo "== $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/cpu-bench.txt"
  timeout 90 "$PY" benchmarks/latency.py 2>&1 | tee -a "$OUT/cpu-bench.txt"
  timeout 240 "$PY" benchmarks/train_torch.py --repeats 2 2>&1 | tee -a "$OUT/cpu-bench.txt"
  # issue 17's other CPU figures where each rank's engine thread has a core: overlap with an
  # emulated backward, bandwidth against memcpy and MPI, 100 x 40 KiB fused against one 4 MiB
  timeout 150 "$PY" benchmarks/overlap.py --steps 20 2>&1 | tee -a "$OUT/cpu-bench.txt"
  timeout 240 "$PY" benchmarks/allreduce.py --runs 1 2>&1 | tee -a "$OUT/cpu-bench.txt"
fi
