"""The rank's side of ``%ring timeline``: its recent collectives, sent back to the kernel."""

import time
from typing import TypedDict

from ..runtime.internal import RecentRecord

__all__ = ["RecentCollectives", "recent_collectives"]


class RecentCollectives(TypedDict):
    """A rank's answer to ``%ring timeline``: its rank (-1 without a runtime), its wall clock
    and the collectives it finished lately."""

    rank: int
    now: float
    records: list[RecentRecord]


def recent_collectives(seconds: float) -> RecentCollectives:
    """``{"rank", "now", "records"}``: the collectives this rank's runtime finished in the last
    ``seconds`` (``runtime._observe.trace.Trace.recent``); no records when the runtime is not started."""
    from ..runtime.internal import api as _api
    from ..runtime.internal import reporter

    trace = reporter.trace if _api.is_initialized() else None
    return {"rank": _api.rank() if trace is not None else -1, "now": time.time(),
            "records": trace.recent(seconds) if trace is not None else []}
