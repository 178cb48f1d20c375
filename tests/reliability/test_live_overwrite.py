"""A live run is never truncated: a second recorder with overwrite=True on a run another process is recording takes
the run's lock before truncating (upd/runfile/writer.py), gets the "being written by another process" refusal as a
RecorderWarning with an inactive recorder (an error with strict=True), and the live run is untouched. Before,
h5py.File(path, "w") truncated the file before HDF5's lock refused the second writer; the first process went on
writing into nothing, and its final file was unreadable."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import upd

LIVE = textwrap.dedent("""
    import os, sys, time, torch, upd
    path = sys.argv[1]
    model = torch.nn.Linear(4, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    deadline = time.monotonic() + 60
    with upd.record(path, model, opt, every=1) as rec:
        step = 0
        while not os.path.exists(path + ".stop") and time.monotonic() < deadline:
            model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
            step += 1
            if step == 3:
                print("recording", flush=True)
            time.sleep(0.01)
    print(rec.records, rec.error, flush=True)
""")


@pytest.mark.slow
def test_overwrite_never_truncates_a_live_run(tmp_path):
    path = str(tmp_path / "run.h5")
    live = subprocess.Popen([sys.executable, "-c", LIVE, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert live.stdout.readline().strip() == "recording", live.stderr.read()
        size = os.path.getsize(path)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second = upd.record(path, model, opt, overwrite=True, every=1)
        assert not second.active
        messages = [str(w.message) for w in caught if issubclass(w.category, upd.RecorderWarning)]
        assert len(messages) == 1 and "being written by another process" in messages[0], messages
        with pytest.raises(OSError, match="being written by another process"):
            upd.record(path, model, opt, overwrite=True, strict=True, every=1)
        assert os.path.getsize(path) >= size  # not truncated
    finally:
        open(path + ".stop", "w").close()
        out, err = live.communicate(timeout=90)
    records, error = out.split()
    assert live.returncode == 0 and error == "None", err
    with upd.open_run(path) as run:  # the live run, whole: every step its recorder committed
        assert run.optimizers[0].num_records == int(records) >= 3
        assert run.closed_cleanly


def test_overwrite_still_replaces_a_finished_run(tmp_path):
    """A run no process has open is replaced, as overwrite=True says."""
    path = str(tmp_path / "run.h5")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for steps in (3, 1):
        with upd.record(path, model, opt, overwrite=True, every=1):
            for _ in range(steps):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
    with upd.open_run(path) as run:
        assert run.optimizers[0].num_records == 1
