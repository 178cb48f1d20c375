"""Recording side: hooks on the optimizer, parameter names, snapshots, statistics on the device, the flight
recorder. The run file itself is written by ``upd.runfile``."""
__all__ = ["Recorder", "RecorderWarning", "TrainingAlert", "record"]


def __getattr__(name: str):
    # Imported when used, as in upd/__init__.py: a module that needs one of this package's modules (device_stats'
    # statistics names, for the reader) then does not import the recorder, which imports that module back.
    if name in __all__:
        from . import recorder

        return getattr(recorder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
