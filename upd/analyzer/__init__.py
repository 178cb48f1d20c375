"""Reading side: open a run, compute ratios, summarize, plot, verify."""
from .run import OptimizerRun, ParamRecord, Run, RunFileError, open_run

__all__ = ["Run", "OptimizerRun", "ParamRecord", "RunFileError", "open_run"]
