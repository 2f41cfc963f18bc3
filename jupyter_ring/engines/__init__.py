"""What runs inside the engines (one per rank), on the far side of the process boundary.

The notebook kernel never imports these modules for itself; it names them in the code it runs on
the ranks (``%ring start``'s setup, the dashboard's publisher) or ships their functions with
``view.apply`` (completion from rank 0):

- ``_setup``: GPU binding before any framework import, the rank's row (``RankRow``), the hook
  that abandons queued collectives after a failed cell;
- ``_publish``: the dashboard's snapshots (``Snapshot``) over ipyparallel's datapub channel;
- ``_complete``: completion and inspection on rank 0;
- ``_keeper``: the process gforker starts for a rank, so that a dead rank can be replaced;
- ``_respawn``: the survivors and the newcomers re-form the runtime's world (a rank replaced).

They import no widget library and no training framework. Below them, also on the engines, is
the runtime (``jupyter_ring.runtime``) and its framework adapters.
"""

__all__ = []
