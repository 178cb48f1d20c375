"""torch on one thread for a while, then back to the caller's setting.

Some of our own work runs torch operations too small for its thread pool to pay off: the ratio sums over
fixed-size chunks, the demo's tiny matmuls. Pool threads then spin and wake per operation, and on a busy 2-core
machine that cost 4-8x the CPU time of one thread (docs/performance.md, "Reading cost"). The setting is
process-wide, so it is restored as soon as that work ends.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def one_torch_thread():
    import torch  # here: importing this module (the reader does) imports no torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
