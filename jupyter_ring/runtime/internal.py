"""The runtime's one interface for the rest of jupyter_ring, not for users.

The engine side (``jupyter_ring.engines``: the rank's setup, the dashboard publisher, the
debugger's ends, torch.distributed's guard), the cluster's ``%ring where`` and the front end's
debugger read and drive the runtime through these names only, never through its private
packages (``_engine``, ``_observe``, ``_device``), so those can change behind this one module.
Users have ``jupyter_ring.runtime`` and the framework adapters; names here may change with the
package.
"""

from . import _api as api
from ._device import process_groups, torch_comm
from ._engine import progress
from ._engine.lost import lost_ranks
from ._horovod import elastic_world
from ._observe import debugger, report, where
from ._observe.debugger import MARK, hold, read_held
from ._observe.report import Reporter, reporter
from ._observe.trace import RecentRecord
from ._observe.where import (WHERE_SIGNAL, Doing, Frame, ThreadStack, cell_source_name, cells_path, doing_path,
                             parse_stacks, read_doing, stack_path)

__all__ = ["api", "process_groups", "torch_comm", "progress", "lost_ranks", "elastic_world", "debugger", "report",
           "where", "MARK", "hold", "read_held", "Reporter", "reporter", "RecentRecord", "WHERE_SIGNAL", "Doing", "Frame",
           "ThreadStack", "cell_source_name",
           "cells_path", "doing_path", "parse_stacks", "read_doing", "stack_path"]
