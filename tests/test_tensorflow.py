"""The TensorFlow and Keras adapters under real mpiexec (one launch per rank count: TF is slow to import)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow", reason="the tensorflow adapter tests need tensorflow: "
                    "pip install 'jupyter_ring[tensorflow]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TF_PUBLIC = {
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "CollectiveMismatchError", "Compression",
    "DistributedGradientTape", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
    "NotInitializedError", "PartialDistributedGradientTape", "ProcessSet", "Product", "RingError",
    "StallError", "Sum", "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object",
    "allreduce", "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_global_variables",
    "broadcast_object", "broadcast_object_fn", "broadcast_variables", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allreduce", "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank", "rank_op", "reducescatter",
    "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "start_timeline", "stats",
    "stop_timeline", "timeline", "FP16Compressor", "NoneCompressor",
}
KERAS_PUBLIC = {
    "Adasum", "Average", "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "CollectiveMismatchError",
    "Compression", "DistributedOptimizer", "HorovodInternalError", "LearningRateScheduleCallback",
    "LearningRateWarmupCallback", "Max", "MetricAverageCallback", "Min", "NotInitializedError",
    "PartialDistributedOptimizer", "ProcessSet", "Product", "ProgressCallback", "RingError", "StallError",
    "Sum", "add_process_set", "allgather", "allgather_object", "allreduce", "barrier", "broadcast",
    "broadcast_global_variables", "broadcast_object", "broadcast_variables", "callbacks", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled",
    "init", "is_homogeneous", "is_initialized", "join", "load_model", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "remove_process_set",
    "rocm_built", "shutdown", "size", "start_timeline", "stats", "stop_timeline", "timeline",
}


def _python(code, **env):
    full = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=full)


def test_public_names_and_missing_framework(framework_adapters):
    # one interpreter (conftest's framework_adapters) for this and test_horovod's name checks
    modules = framework_adapters["modules"]
    tf_names, keras_names = modules["jupyter_ring.runtime.tensorflow"], modules["jupyter_ring.runtime.keras"]
    assert tf_names["all"] == sorted(TF_PUBLIC)
    assert keras_names["all"] == sorted(KERAS_PUBLIC)
    assert tf_names["undocumented"] == [] and keras_names["undocumented"] == []
    assert framework_adapters["beside_tensorflow"] == {"torch": False, "cupy": False}, \
        "the tensorflow adapter must import only tensorflow"


def test_keras2_has_the_same_names_and_a_missing_tf_keras_names_the_fix():
    # TF_USE_LEGACY_KERAS=1: tf.keras is tf_keras, and the adapters follow it with the same names
    code = f"""
import jupyter_ring.runtime.tensorflow as t, jupyter_ring.runtime.keras as k
print(t.LEGACY_KERAS, type(k.DistributedOptimizer).__name__, t.SyncBatchNormalization.__mro__[1].__module__)
print(sorted(k.__all__) == {sorted(KERAS_PUBLIC)!r}, all(getattr(k, n).__doc__ for n in k.__all__ if n != 'callbacks'))
"""
    out = _python(code, TF_USE_LEGACY_KERAS="1", KERAS_BACKEND="tensorflow")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:2] == ["True", "function"] and lines[0].split()[2].startswith("tf_keras."), out.stdout
    assert lines[1] == "True True", out.stdout
    code = ("import sys; sys.modules['tf_keras'] = None\n"
            "try:\n    import jupyter_ring.runtime.tensorflow\nexcept ImportError as e:\n    print(e)\n")
    out = _python(code, TF_USE_LEGACY_KERAS="1")
    assert "TF_USE_LEGACY_KERAS='1'" in out.stdout and "pip install 'tf_keras~=" in out.stdout, out


@pytest.mark.parametrize("module,extra", [("tensorflow", "the tensorflow adapter needs tensorflow"),
                                          ("keras", "the keras adapter needs tensorflow")])
def test_missing_tensorflow_names_the_extra(module, extra):
    blocked = "tensorflow" if module == "tensorflow" else "keras"
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"
            f"try:\n    import jupyter_ring.runtime.{module}\nexcept ImportError as e:\n    print(e)\n")
    out = _python(code)
    assert extra in out.stdout and "pip install 'jupyter_ring[tensorflow]'" in out.stdout, out


# 3 ranks: tests/mpi/hvd_tf.py (test_horovod.py), {0,2} of 3 included; 4 ranks outnumber the cores here
@pytest.mark.parametrize("n", [2, 4])
def test_tensorflow_and_keras(tf_job, n):
    result = tf_job("tf_all.py", n)  # in the TensorFlow job of its world size (conftest's tf_job)
    ranks = sorted(int(line.split()[1]) for line in result.lines("TF_ALL_OK"))
    assert ranks == list(range(n)), result.stdout


@pytest.mark.parametrize("n", [1, 3])
def test_keras2_tf_keras(mpirun, n):
    """Keras 2 (tf_keras under TF_USE_LEGACY_KERAS=1, which scripts/setup.sh installs): fit with
    both optimizer families, callbacks, partial and sparse gradients, load_model, SyncBatchNormalization."""
    result = mpirun("keras2.py", n, timeout=300, env={"TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1"})
    ranks = sorted(int(line.split()[1]) for line in result.lines("KERAS2_OK"))
    assert ranks == list(range(n)), result.stdout


KERAS2_CELL = '''%%distributed
import os, json
os.environ["TF_USE_LEGACY_KERAS"] = "1"   # the ranks have not imported TensorFlow yet
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf
import jupyter_ring.runtime.keras as hvd
hvd.init()
tf.keras.utils.set_random_seed(hvd.rank())      # different starts: the callback aligns them
model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))])
opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9))
model.compile(optimizer=opt, loss="mse", experimental_run_tf_function=False)
x = np.random.default_rng(hvd.rank()).standard_normal((8, 4)).astype("float32")
model.fit(x, x[:, :3], batch_size=4, epochs=2, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
w = np.concatenate([v.numpy().ravel() for v in model.weights])
every = hvd.allgather(w[None])
print(json.dumps([hvd.LEGACY_KERAS, type(opt).__mro__[2].__module__, bool(np.array_equal(every[0], every[1])),
                  bool(np.isfinite(w).all() and np.abs(w).sum() > 0)]))
'''


def test_keras2_in_a_notebook_cell():
    """A %%distributed cell switches its ranks to Keras 2 before importing TensorFlow and trains a
    Horovod-style Keras 2 model: both ranks end with the same weights."""
    from real_kernel import cluster_pids, ring_kernel

    with ring_kernel(2) as k:
        cluster_pids(k)
        out = k.ok(KERAS2_CELL, timeout=240)
    want = '[true, "tf_keras.src.optimizers.legacy.gradient_descent", true, true]'
    assert sorted(line for line in out.splitlines() if want in line) == [f"[rank 0] {want}", f"[rank 1] {want}"], out
