"""Recording side: hooks on the optimizer, snapshots, HDF5 writer."""
from .recorder import Recorder, RecorderWarning, record

__all__ = ["Recorder", "RecorderWarning", "record"]
