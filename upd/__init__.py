"""torch-upd: see what your optimizer does.

    import upd
    with upd.record("run.h5", model, optimizer):
        train()
    upd.open_run("run.h5").ratios()     # update:data and grad:data ratios, a pandas DataFrame
    upd.verify("run.h5")                 # replay the optimizer's math against the recorded updates
"""
__version__ = "0.1.0"

from .recorder import Recorder, RecorderWarning, record  # noqa: E402
from .runfile import Job, Run, RunFileError, open_run  # noqa: E402
from .replay.engine import VerifyReport, verify  # noqa: E402
from .analyzer.analyze import Analysis, analyze  # noqa: E402
from .analyzer.compare import Comparison, compare  # noqa: E402
from .analyzer.summary import Thresholds  # noqa: E402
from . import replay  # noqa: E402

__all__ = ["record", "Recorder", "RecorderWarning", "open_run", "Run", "Job", "RunFileError", "verify", "VerifyReport",
           "analyze", "Analysis", "compare", "Comparison", "Thresholds", "replay", "__version__"]
