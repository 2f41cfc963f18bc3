"""The cupy adapter: NCCL and staged paths on GPUs; a clear error where there is no GPU."""

import os
import subprocess
import sys

import pytest

cupy = pytest.importorskip("cupy", reason="the cupy adapter tests need cupy: pip install 'jupyter_ring[cupy]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_gpu():
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU
        return False


HAS_GPU = _has_gpu()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU here (cupy.cuda.is_available() is False)")


def test_public_names():
    import jupyter_ring.runtime.cupy as ring

    assert set(ring.__all__) == {
        "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
        "cross_rank", "Sum", "Average", "Min", "Max", "Product", "Adasum", "gpu_available", "nccl_available",
        "allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "reducescatter", "alltoall",
        "barrier", "broadcast_object", "allgather_object", "stats", "timeline",
        "RingError", "NotInitializedError", "CollectiveMismatchError", "StallError",
        # process sets are the runtime's, registered for every adapter (cupy's collectives run on the
        # global set)
        "ProcessSet", "global_process_set", "add_process_set", "remove_process_set"}
    assert all(hasattr(ring, name) for name in ring.__all__)


def test_missing_cupy_names_the_extra():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "try:\n    import jupyter_ring.runtime.cupy\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "the cupy adapter needs cupy: pip install 'jupyter_ring[cupy]'" in out.stdout


@pytest.mark.skipif(HAS_GPU, reason="checks the error shown on machines without a GPU")
def test_without_gpu_collectives_explain_what_is_missing():
    code = """
import cupy, numpy as np
import jupyter_ring.runtime.cupy as ring
ring.init()
assert not ring.gpu_available() and not ring.nccl_available()
try:
    ring.allreduce(np.ones(3))
except TypeError as e:
    print("TYPE", e)
try:
    ring._require_gpu("allreduce 'x'")
except ring.RingError as e:
    print("RING", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "TYPE" in out.stdout and "cupy.ndarray" in out.stdout
    assert "needs a CUDA GPU" in out.stdout and "cupy.cuda.is_available() is False" in out.stdout


# the device transport (torch installed: DLPack to torch, NCCL through torch.distributed), cupy's
# own NCCL (the transport switched off), staged through pinned host memory
PATHS = {"transport": {}, "cupy-nccl": {"JUPYTER_RING_DEVICE_TRANSPORT": "off"},
         "staged": {"JUPYTER_RING_CUPY_NCCL": "0"}}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("n", [1, 2])
def test_collectives_on_gpu(mpirun, n, path):
    if n > cupy.cuda.runtime.getDeviceCount() and path != "staged":
        pytest.skip(f"{n} ranks need {n} GPUs for NCCL (it refuses two ranks on one device)")
    result = mpirun("cupy_collectives.py", n, env=PATHS[path])
    assert sorted(int(line.split()[1]) for line in result.lines("CUPY_OK")) == list(range(n)), result.stdout
