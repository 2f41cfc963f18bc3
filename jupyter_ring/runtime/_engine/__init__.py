"""The runtime's engine: everything between a collective call and the bytes on the wire.

- ``core``: ``Runtime``, one per process: the communicators, agreement (headers, eager payloads,
  the agreement cache), polled point-to-point waits, resync and abandon, stall timeouts;
- ``collectives``: the algorithm bodies ``Runtime.run`` runs (eager, one-host shared memory, the
  ring over mpi4py), which are also the host transports;
- ``progress``: the queue of typed entries per process set, rounds, fusion, matching by name,
  the background thread;
- ``shm`` (the shared-memory slots), ``waits`` (how a wait spends its core), ``pool`` (recycled
  result and bucket memory), ``config`` (``JUPYTER_RING_*``), ``errors`` (``RingError`` and its
  subclasses).

Imports: the standard library, numpy, mpi4py and ``.._observe`` only; never the numpy API
(``.._api``), the device transport or an adapter.
"""
