"""The torch adapter under real mpiexec: collectives, DistributedOptimizer equivalence, misuse."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the torch adapter tests need torch: pip install 'jupyter_ring[torch]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PUBLIC = {
    "Adasum", "Average", "CollectiveMismatchError", "Compression", "DistributedOptimizer",
    "HorovodInternalError", "Max", "Min", "NotInitializedError",
    "ProcessSet", "Product", "RingError",
    "StallError", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stats", "stop_timeline", "synchronize", "timeline",
    "FP16Compressor", "Handle", "NoneCompressor",
}


def test_public_names():
    import jupyter_ring.runtime.torch as hvd

    assert set(hvd.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(hvd, name).__doc__, f"{name} has no docstring"


def test_distributed_optimizer_is_a_plain_subclass():
    import torch

    import jupyter_ring.runtime.torch as hvd

    # a static subclass (LR schedulers need isinstance(opt, Optimizer)), never one made by type()
    assert issubclass(hvd.DistributedOptimizer, torch.optim.Optimizer)
    assert hvd.DistributedOptimizer.__module__ == "jupyter_ring.runtime.torch.optimizer"


def test_missing_torch_names_the_extra():
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import jupyter_ring.runtime.torch\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "the torch adapter needs torch: pip install 'jupyter_ring[torch]'" in out.stdout


def test_importing_the_runtime_does_not_import_torch():
    code = "import jupyter_ring.runtime, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def _all_ranks(result, marker, n):
    lines = result.lines(marker)
    assert sorted(int(line.split()[1]) for line in lines) == list(range(n)), result.stdout


# The scripts run in jobs of several, one per world size and transport (conftest's ``torch_job``).
# The device transport (NCCL for CUDA tensors) runs the same code over gloo on CPU tensors when
# JUPYTER_RING_DEVICE_TRANSPORT=gloo: the whole collective and training suites go through it, and
# it trains, fails and rebuilds at 2 and 4 ranks (4 outnumber the cores here).


@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives(torch_job, n):
    _all_ranks(torch_job("torch_collectives.py", n), "TORCH_COLLECTIVES_OK", n)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives_through_the_device_transport(torch_job, n):
    _all_ranks(torch_job("torch_collectives.py", n, gloo=True), "TORCH_COLLECTIVES_OK", n)


@pytest.mark.parametrize("n", [2, 4])
def test_training_and_misuse_through_the_device_transport(torch_job, n):
    _all_ranks(torch_job("torch_train.py", n, gloo=True), "TORCH_TRAIN_OK", n)
    _all_ranks(torch_job("torch_errors.py", n, gloo=True), "TORCH_ERRORS_OK", n)


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_device_transport_failures_abort_and_rebuild(torch_job, n):
    # mismatch, bad arguments, an interrupt and a stall while a transfer is in flight, and the
    # user's default group shared, aborted and re-created in place (DDP keeps working)
    _all_ranks(torch_job("torch_device.py", n, gloo=True), "TORCH_DEVICE_OK", n)


@pytest.mark.parametrize("n", [2, 3])  # one rank: test_collectives[1] and the reference itself
def test_training_matches_one_process(torch_job, n):
    # MLP and CNN (SGD+momentum and Adam), fp16 compression, backward_passes_per_step=2,
    # unused parameters, per-rank hook order, broadcast_optimizer_state, LR scheduler
    _all_ranks(torch_job("torch_train.py", n), "TORCH_TRAIN_OK", n)


@pytest.mark.parametrize("n", [2, 3])
def test_misuse_raises_on_every_rank(torch_job, n):
    _all_ranks(torch_job("torch_errors.py", n), "TORCH_ERRORS_OK", n)


def test_horovod_style_script_runs_unchanged(mpirun, tmp_path):
    script = os.path.join(ROOT, "examples", "horovod_style_torch.py")
    with open(script) as fh:
        imports = [line for line in fh if line.startswith(("import ", "from "))]
    assert "import jupyter_ring.runtime.torch as hvd  # was: import horovod.torch as hvd\n" in imports
    ckpt = tmp_path / "ckpt"
    result = mpirun(script, 2, "--epochs", "2", "--checkpoint-dir", ckpt)
    _all_ranks(result, "HOROVOD_STYLE_DONE", 2)
    assert (ckpt / "checkpoint.pt").exists()
    accuracy = float(result.lines("HOROVOD_STYLE_DONE")[0].split()[-1])
    assert accuracy > 0.8, result.stdout
    # resuming from rank 0's checkpoint continues at epoch 2 on every rank
    result = mpirun(script, 2, "--epochs", "1", "--checkpoint-dir", ckpt, "--fp16-allreduce")
    assert "epoch 2:" in result.stdout
    _all_ranks(result, "HOROVOD_STYLE_DONE", 2)


@pytest.mark.parametrize("n", [2, 3])
def test_buckets_zero_copy_exact_averages_overlap_and_process_set(torch_job, n):
    # grads are views of registered memory, exact means bit-identical across ranks (awkward
    # sizes, an empty and an unused parameter, two dtypes, a parameter larger than a bucket);
    # with backward emulated layer by layer, bucket allreduces start before backward ends
    result = torch_job("torch_overlap.py", n)
    _all_ranks(result, "TORCH_OVERLAP_OK", n)
    assert len(result.lines("OVERLAP")) == n


def _gpu_count():
    import torch

    try:
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU
        return 0


GPUS = _gpu_count()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU here (torch.cuda.device_count() is 0): the NCCL "
                                      "path of the device transport runs on a GPU machine only")
@pytest.mark.parametrize("n", [1, 2])
def test_cuda_tensors_go_through_nccl_unstaged(mpirun, n):
    if n > GPUS:
        pytest.skip(f"{n} ranks need {n} GPUs (NCCL refuses two ranks on one device); {GPUS} here")
    # a hang inside NCCL (the abort and rebuild section) ends at the stall timeout, not at pytest's
    result = mpirun("torch_cuda.py", n, env={"JUPYTER_RING_STALL_TIMEOUT": "60"}, timeout=300)
    _all_ranks(result, "TORCH_CUDA_OK", n)
    print(result.lines("TORCH_CUDA_OK"))


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU here (torch.cuda.device_count() is 0): staging CUDA "
                                      "tensors through pinned host buffers needs a GPU")
@pytest.mark.parametrize("n", [1, 2])
def test_cuda_tensors_staged_through_pinned_buffers(mpirun, n):
    # two ranks may share one GPU here: with the transport off, NCCL is never asked to
    result = mpirun("torch_cuda_staged.py", n, env={"JUPYTER_RING_DEVICE_TRANSPORT": "off"}, timeout=300)
    _all_ranks(result, "TORCH_STAGED_OK", n)
    print(result.lines("TORCH_STAGED_OK"))


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU here (torch.cuda.device_count() is 0): torch.distributed "
                                      "over NCCL in the cluster's world needs a GPU")
def test_cluster_torch_distributed_world_on_a_gpu(mpirun):
    # %ring start's rank setup (engines._torch with init_backend="auto"), a rank per GPU (NCCL
    # refuses two ranks on one): NCCL default group, DDP (equal to one process from 2 GPUs on), the
    # runtime sharing the user's communicator, Lightning strategy="ddp"
    pytest.importorskip("lightning", reason="the GPU world test trains Lightning too: pip install 'jupyter_ring[frameworks]'")
    result = mpirun("torch_cuda_dist.py", GPUS, timeout=300)
    _all_ranks(result, "TORCH_CUDA_DIST_OK", GPUS)
    print(result.lines("TORCH_CUDA_DIST_OK"))

