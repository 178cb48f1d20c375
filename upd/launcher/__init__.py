"""The zero-code launcher, ``upd record RUN -- COMMAND``: records a training program that was never edited for it.

The launcher cannot call ``upd.record`` inside someone else's script, so it reaches the program from outside: it
puts a bootstrap directory on ``PYTHONPATH`` and the recording options in an environment variable (``env``), then
replaces itself with the command. Every Python process the command starts, workers of ``torchrun`` and
``torch.multiprocessing`` included, loads the bootstrap's ``sitecustomize``, which waits until the process imports
torch and then installs torch's global optimizer hooks (``global_hooks``). The first optimizer step attaches an
ordinary ``upd.Recorder`` to the optimizers the process created, with names from the model that owns their
parameters (``attach``). A process that never steps an optimizer writes nothing.
"""
