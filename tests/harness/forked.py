"""Run several `python -c CODE ARGS...` programs one after the other as forked children of one process that imported
torch and upd once: each program then costs its own work, not a Python importing torch again (about 2.5 s of CPU,
most of such a child's time).

Each child is the program as `python -c` would run it: ``__main__`` globals, ``sys.argv == ["-c", *args]``, its
stdout and stderr in files of its own, and the interpreter's own exit (atexit handlers, an uncaught exception's
traceback and exit status 1, ``sys.exit``). Nothing of torch-upd is open in the parent when it forks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import NamedTuple, Sequence

PARENT = """
import json, os, sys, torch, upd
jobs = json.loads(sys.argv[1])
for code, args, out, err in jobs:
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, out), (2, err)):
            target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        del jobs, pid
        sys.argv = ["-c", *args]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        sys.exit(0)  # the interpreter's own exit, as at the end of `python -c CODE`
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Done(NamedTuple):
    returncode: int  # negative: the signal that ended it
    stdout: str
    stderr: str


def run_forked(programs: Sequence[tuple], timeout: float = 300) -> list:
    """[(code, [args...]), ...] -> [Done, ...], in order."""
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(code, [str(a) for a in args], os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err"))
                for i, (code, args) in enumerate(programs)]
        parent = subprocess.run([sys.executable, "-c", PARENT, json.dumps(jobs)], capture_output=True, text=True,
                                timeout=timeout)
        codes = parent.stdout.split()
        assert parent.returncode == 0 and len(codes) == len(jobs), parent.stdout + parent.stderr
        done = []
        for code, (_, _, out, err) in zip(codes, jobs):
            with open(out) as o, open(err) as e:
                done.append(Done(int(code), o.read(), e.read()))
        return done
