"""One optimizer's clipping summary, as the tests ask for it (the package gives every optimizer's:
upd.analyzer.clipping.summarize_clipping)."""
from __future__ import annotations

from upd.analyzer.clipping import ClippingSummary, summarize_clipping


def clipping_summary(run, optimizer: int = 0) -> ClippingSummary | None:
    """The ClippingSummary of one optimizer of an open run (or job); None when the norms were not recorded."""
    found = [s for s in summarize_clipping(run.scalars()) if s.optimizer == optimizer]
    return found[0] if found else None
