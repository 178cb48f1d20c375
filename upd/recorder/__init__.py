"""Recording side: hooks on the optimizer, parameter names, snapshots, statistics on the device, the flight
recorder. The run file itself is written by ``upd.runfile``."""
from .recorder import Recorder, RecorderWarning, record

__all__ = ["Recorder", "RecorderWarning", "record"]
