"""torch-upd: see what your optimizer does.

    import upd
    with upd.record("run.h5", model, optimizer):
        train()
    upd.open_run("run.h5").ratios()     # update:data and grad:data ratios, a pandas DataFrame
    upd.verify("run.h5")                 # replay the optimizer's math against the recorded updates
"""
__version__ = "0.1.0"

# Each name is imported from its module when first used: a command that only reads a run (`upd info`) then never
# imports torch (3 s and 200 MB of a 1 s answer).
_WHERE = {"record": ".recorder", "Recorder": ".recorder", "RecorderWarning": ".recorder", "TrainingAlert": ".recorder",
          "open_run": ".runfile", "Run": ".runfile", "Job": ".runfile", "RunFileError": ".runfile",
          "verify": ".replay.engine", "VerifyReport": ".replay.engine",
          "analyze": ".analyzer.analyze", "Analysis": ".analyzer.analyze",
          "compare": ".analyzer.compare", "Comparison": ".analyzer.compare",
          "Thresholds": ".analyzer.summary", "replay": None, "sinks": None}

__all__ = ["record", "Recorder", "RecorderWarning", "TrainingAlert", "open_run", "Run", "Job", "RunFileError", "verify",
           "VerifyReport",
           "analyze", "Analysis", "compare", "Comparison", "Thresholds", "replay", "sinks", "__version__"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'upd' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f".{name}" if _WHERE[name] is None else _WHERE[name], __name__)
    value = module if _WHERE[name] is None else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
