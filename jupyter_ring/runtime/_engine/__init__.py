"""The runtime's engine: everything between a collective call and the bytes on the wire.

- ``core``: ``Runtime``, one per process: the communicators and the state its parts share, and
  ``Runtime.run`` (one collective's tries); its parts:
  ``agreement`` (the header exchange: headers, eager payloads, joins, poison, the agreement
  cache), ``headers`` (the eager buffers and persistent header requests), ``polling`` (the
  interruptible, stall-checked waits), ``recovery`` (resync and abandon);
  ``wire`` (the header's layout, ops, dtypes, tags), ``control`` (the exceptions that steer a
  collective: ``Restart``, ``Recut``, ``Disagree``, ``Replan``, ``Abandoned``), ``mismatch``
  (explaining a disagreement);
- ``collectives``: the algorithm bodies ``Runtime.run`` runs (eager, one-host shared memory, the
  ring over mpi4py), which are also the host transports;
- ``progress``: ``Engine``, one per process set, the caller's side (submit, run now, wait,
  abandon) and its executor lock; its parts: ``entries`` (the typed entries and their queue,
  fusion into batches), ``rounds`` (what the executor runs: rounds, recuts, a batch's failure),
  ``settling`` (matching the ranks' queues by name), ``background`` (the background thread);
- ``shm`` (the shared-memory slots), ``waits`` (how a wait spends its core), ``pool`` (recycled
  result and bucket memory), ``config`` (``JUPYTER_RING_*``), ``errors`` (``RingError`` and its
  subclasses).

Imports: the standard library, numpy, mpi4py and ``.._observe`` only; never the numpy API
(``.._api``), the device transport or an adapter.
"""
