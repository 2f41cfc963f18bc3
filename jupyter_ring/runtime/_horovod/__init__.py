"""What every framework adapter shares: Horovod's names and helpers below torch/, tensorflow/,
keras/ and cupy.

- ``runtime_names``: the numpy runtime's names every adapter re-exports unchanged (``init``,
  ``rank``, the reduce ops, process sets, the errors);
- ``basics``: Horovod's own module-level names (capability functions, the timeline, ``join``,
  ``HorovodInternalError``) and the reduce plan and Adasum combination the adapters use;
- ``elastic``: Horovod's elastic ``State``, ``ObjectState`` and ``run`` for a fixed world.

Imports the numpy API (``jupyter_ring.runtime``, ``.._api``), ``.._engine`` and numpy; never a
framework or an adapter.
"""
