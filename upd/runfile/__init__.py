"""The run file, both sides: its schema, encoding, writer, reader and the live-read lock protocol.

Nothing outside this package names an HDF5 group, dataset or attribute: ask ``schema`` for the names.
"""
from .reader import OptimizerRun, ParamRecord, Run, RunFileError, open_run

__all__ = ["Run", "OptimizerRun", "ParamRecord", "RunFileError", "open_run"]
