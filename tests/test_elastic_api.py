"""Horovod's elastic API (issue 34, item 5): ``ElasticSampler``, state sync/commit/restore, ``run``'s
resets after ``HorovodInternalError`` and after a host update, reset callbacks, and the runtime's
hooks for a world that changes (``_elastic_world``), under real mpiexec at 1-4 ranks.

tests/mpi/elastic_api.py does the checks (every rank its own); tests/test_horovod.py's
``hvd_elastic.py`` launch covers the TensorFlow and Keras states and callbacks.
"""

import pytest

from jupyter_ring.runtime._horovod import elastic_world as _elastic_world

pytest.importorskip("torch", reason="needs torch: pip install 'jupyter_ring[torch]'")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_elastic_api_on_a_fixed_world(torch_job, n):
    """Sampler partitions (sizes 0, 1, primes, n +- 1; shuffle on and off), a mid-epoch commit and
    re-partition, state_dict round trips, state sync of random models, Adam and samplers, ``run``
    after a failure and after host updates told to one rank only (in the torch job of its world
    size: conftest's ``torch_job``)."""
    result = torch_job("elastic_api.py", n)
    assert sorted(int(line.split()[1]) for line in result.lines("ELASTIC_API_OK")) == list(range(n)), result.stdout


@pytest.mark.parametrize("before,after", [(3, 2), (2, 4)])
def test_elastic_sampler_goes_on_in_another_world(mpirun, tmp_path, before, after):
    """Part of an epoch on one world, committed; the rest on a smaller or larger one: every sample
    of the epoch once (the padding apart), none both before and after."""
    path = tmp_path / "sampler.json"
    mpirun("elastic_api.py", before, "save", path, 4, timeout=300, env={"PYTHONWARNINGS": "ignore"})
    result = mpirun("elastic_api.py", after, "resume", path, timeout=300, env={"PYTHONWARNINGS": "ignore"})
    assert sorted(int(line.split()[1]) for line in result.lines("ELASTIC_API_OK")) == list(range(after)), result.stdout


def test_the_signal_and_the_hooks_refuse_nonsense():
    """notify_hosts_updated takes a HostUpdateResult (or its int), on_world_reset a function."""
    with pytest.raises(ValueError, match="HostUpdateResult"):
        _elastic_world.notify_hosts_updated("added")
    with pytest.raises(ValueError, match="HostUpdateResult"):
        _elastic_world.notify_hosts_updated(7)
    with pytest.raises(TypeError, match="function of no arguments"):
        _elastic_world.on_world_reset(None)
    assert _elastic_world.notify_hosts_updated(2, timestamp=12.5) == 12.5  # no listener: dropped


def test_a_listener_hears_updates_from_another_thread():
    """The runtime's signal reaches every registered state, from any thread, until removed."""
    import threading

    heard = []

    class Listener:
        def on_hosts_updated(self, timestamp, update_res):
            heard.append((timestamp, update_res))

    listener = Listener()
    manager = _elastic_world.notification_manager
    manager.register_listener(listener)
    manager.register_listener(listener)  # once only
    try:
        told = threading.Thread(target=_elastic_world.notify_hosts_updated,
                                args=(_elastic_world.HostUpdateResult.removed, 3.0))
        told.start()
        told.join()
    finally:
        manager.remove_listener(listener)
    _elastic_world.notify_hosts_updated(_elastic_world.HostUpdateResult.added, 4.0)
    assert heard == [(3.0, _elastic_world.HostUpdateResult.removed)]
    assert manager.listeners() == 0


@pytest.mark.parametrize("n", [2, 3])
def test_a_wait_on_a_rank_said_dead_raises_rank_lost_error(mpirun, n):
    """``lost_ranks`` names the last rank dead: the others' collective raises RankLostError (a
    HorovodInternalError) at once, ``elastic.run`` restores its commit and resets; afterwards
    the world's collectives are exact."""
    result = mpirun("lost_ranks.py", n, timeout=120)
    assert sorted(int(line.split()[1]) for line in result.lines("LOST_OK")) == list(range(n)), result.stdout


@pytest.mark.parametrize("n", [1, 2, 4])  # 4 outnumber the cores here
def test_ring_elastic_runs_numpy_training_through_a_failed_step(mpirun, n):
    """``ring.elastic`` (numpy, no framework): run syncs rank 0's start to every rank, a step that
    fails on every rank rolls back to the last commit (arrays changed in place too: commit keeps a
    copy), the reset callback runs once, and the weights equal a run without the failure."""
    result = mpirun("ring_elastic.py", n, timeout=120)
    assert sorted(int(line.split()[1]) for line in result.lines("RING_ELASTIC_OK")) == list(range(n)), result.stdout
