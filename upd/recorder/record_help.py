"""What ``help(upd.record)``, ``inspect.signature`` and IDEs show for ``upd.record`` and ``upd.Recorder``.

``upd.record(path, model, optimizer, **options)`` takes its options as keywords (``Recorder`` checks them through
``RecordOptions``), which would hide them all from ``help()`` and from an IDE's completion; ``document`` gives both
the entry point's documentation, with an entry for every option, and an explicit signature, both made from
``RecordOptions`` (options.py), so that an option is declared once.
"""
from __future__ import annotations

import inspect

from .options import documented_options, record_signature

# upd.record's docstring: {options} becomes every option's entry (options.documented_options), at the Args section's
# indentation. Indented as a docstring written in the function is, which help() and inspect.getdoc() expect.
RECORD_DOC = """Record what ``optimizer.step()`` does, to one HDF5 file, without changing the training loop.

    ::

        with upd.record("runs/exp1.h5", model, optimizer):
            train()

    Args:
        path: the run file to create. An existing file is refused unless ``overwrite=True``. In a distributed job
            (an initialised ``torch.distributed`` process group of several processes; make the same call on every
            rank) `path` names the job: each recording rank writes its own file, ``runs/exp1.rank0-of-4.h5`` and so
            on, or `path` itself when rank 0 alone records. ``upd.open_run(path)`` reads the whole job.
        model: optional ``nn.Module``; parameter names come from ``model.named_parameters()`` (through a
            ``DistributedDataParallel`` wrapper: no ``module.`` prefix; through ``torch.compile``: no ``_orig_mod.``).
            Without it names come from the optimizer's ``param_names`` (when built from ``named_parameters()``),
            else ``group{g}.param{i}``.
        optimizer: a ``torch.optim.Optimizer`` or a list of them. A wrapper that exposes the optimizer it wraps as
            ``.optimizer``, ``.optim`` or ``._optimizer`` (Accelerate's ``AcceleratedOptimizer``, Lightning's
            ``LightningOptimizer``) is recorded through: the optimizer inside. A ``ZeroRedundancyOptimizer`` is
            recorded through its local optimizer: each rank records the partition it steps. What cannot be recorded
            (not an optimizer, a model that is not a module, a file that cannot be created) warns once
            (``upd.RecorderWarning``) and gives an inactive recorder, with no file; a bad option value, an
            existing file without ``overwrite=True`` and a run ``resume=True`` cannot continue are raised.
        {options}

    The returned ``Recorder`` also stores per-step scalars: ``rec.log(loss=loss)`` (see ``Recorder.log``), and
    logs, at each recorded step, the total gradient norm as the backward pass left it and as the step saw it
    (clipping shows as the second smaller: ``upd info`` says on how many steps).
    """

# The arguments before the options, as upd.record and Recorder take them.
LEADING = [inspect.Parameter("path", inspect.Parameter.POSITIONAL_OR_KEYWORD),
           *(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
             for name in ("model", "optimizer"))]


def document(record, recorder_class) -> None:
    """Give `record` (``upd.record``) its documentation and its signature, and ``recorder_class.__init__`` the same
    signature. A `record` without a docstring keeps none: ``python -OO`` dropped the docstrings on purpose."""
    if record.__doc__:
        record.__doc__ = RECORD_DOC.replace("        {options}", documented_options(indent=8))
    record.__signature__ = record_signature(*LEADING)
    recorder_class.__init__.__signature__ = record_signature(
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *LEADING)
