"""The run file, both sides: its schema, encoding, writer, reader and the live-read lock protocol.

Nothing outside this package names an HDF5 group, dataset or attribute: ask ``schema`` for the names.

- ``schema``: the layout, declared once (docs/format.md states the same); ``encoding``: JSON and dtypes;
- writing: ``record`` (the writer's input), ``writer``, ``datasets`` (new datasets as the schema declares them),
  ``async_writer``; ``livelock`` (reading while writing); ``tensor_blocks`` (a stored tensor read in blocks);
- reading: ``errors`` (RunFileError, the I/O edge), ``guards`` (HDF5 byte-level checks), ``validate`` (structure
  checks against the schema), ``reader`` (Run, OptimizerRun, ParamRecord), ``param_index`` (every parameter listed
  in one attribute, written at close), ``stats_table``;
- a distributed job: ``ranks`` (which file each rank writes), ``job`` (Job: the rank files read as one run);
- ``opening``: open_run, a path to a Run or a Job.
"""
from .reader import OptimizerRun, ParamRecord, Run, RunFileError
from .opening import open_run

__all__ = ["Run", "Job", "OptimizerRun", "ParamRecord", "RunFileError", "open_run"]


def __getattr__(name: str):
    if name == "Job":  # imported when used: job.py imports torch, which reading one file never needs
        from .job import Job

        return Job
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
