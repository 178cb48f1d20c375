"""Verify replays a parameter block by block (upd/replay/blocks.py): the result is the same as replaying each tensor
whole, corruptions are still caught, and worker processes (jobs=) give the same checks as one."""
import h5py
import numpy as np
import pandas as pd
import pytest
import torch

import upd
from upd.replay import blocks
from upd.runfile import schema, tensor_blocks

from tests.harness.cases import all_cases
from tests.harness.replay_matrix import record_case

CASES = {c.id: c for c in all_cases()}
# One case per optimizer family and per kind of rule: elementwise (cut anywhere), whole rows (SparseAdam), whole
# tensor (Adafactor), scalar state entries (ASGD's eta and mu), sparse gradients, conv and attention shapes.
FAMILIES = ["adamw-wd-forloop", "sgd-nesterov-conv", "asgd-plain-forloop", "rprop-conv", "adagrad-sparse-forloop",
            "sparseadam-plain", "adafactor-plain-forloop", "rmsprop-momentum-forloop", "radam-wd-conv",
            "nadam-wd-forloop", "adamax-wd-conv", "adadelta-foreach-attention", "muon-default"]
QUICK = {"adamw-wd-forloop", "sparseadam-plain"}
EXACT = ["status", "record", "step", "max_abs_err", "err_to_tol", "state_checked", "state_err_to_tol",
         "update_resolved", "update_rel_err"]


def _tiny_blocks(monkeypatch):
    # 7 elements per block and 3 per rule call: every weight spans many blocks (two passes) and chunks.
    monkeypatch.setattr(tensor_blocks, "BLOCK_ELEMENTS", 7)
    monkeypatch.setattr(blocks, "CHUNK_ELEMENTS", 3)


def _corrupt(path, record=2):
    """Move one element in the middle of the largest weight's recorded update far off, at one record."""
    with h5py.File(path, "r+") as f:
        params = f[schema.PARAMS_GROUP.path(k=0)]
        name = max(params, key=lambda n: params[n][schema.KIND_PARAM].shape[1:] and
                   int(np.prod(params[n][schema.KIND_PARAM].shape[1:])))
        p = params[name]
        row = list(p[schema.RECORD_INDEX][()]).index(record)
        before, after = p[schema.KIND_PARAM][row], p[schema.KIND_PARAM_AFTER][row]
        flat = after.reshape(-1).copy()
        middle = flat.size // 2
        flat[middle] += 10 * (np.abs(after - before).max() + 1e-3)
        p[schema.KIND_PARAM_AFTER][row] = flat.reshape(after.shape)
    return name


@pytest.mark.parametrize("corrupted", [False, True], ids=["honest", "corrupted"])
@pytest.mark.parametrize("case_id", [pytest.param(c, marks=() if c in QUICK else pytest.mark.slow) for c in FAMILIES])
def test_block_by_block_gives_the_same_checks_as_whole_tensors(case_id, corrupted, tmp_path, monkeypatch):
    case = CASES[case_id]
    path = record_case(case, str(tmp_path / "run.h5"))
    name = _corrupt(path) if corrupted else None
    whole = upd.verify(path).checks
    _tiny_blocks(monkeypatch)
    cut = upd.verify(path).checks
    pd.testing.assert_frame_equal(cut[["param", *EXACT]], whole[["param", *EXACT]], check_exact=True)
    honest = cut["status"] != "mismatch"
    assert (cut.loc[honest, "note"] == whole.loc[honest, "note"]).all()
    if corrupted:
        bad = cut[cut["status"] == "mismatch"]
        assert (name, 2) in set(zip(bad["param"], bad["record"])), upd.verify(path).summary()
    else:
        assert (cut["status"] != "mismatch").all()


def test_element_blocks_cover_the_tensor_once_in_order():
    shape = (5, 4, 3)
    for limit in (1, 2, 5, 12, 13, 59, 60, 100):
        seen = np.concatenate([np.arange(60).reshape(shape)[index].reshape(-1)
                               for index in tensor_blocks.element_blocks(shape, limit)])
        assert seen.tolist() == list(range(60)), limit
        assert all(np.arange(60).reshape(shape)[i].size <= max(limit, 1) for i in tensor_blocks.element_blocks(shape, limit))
    rows = tensor_blocks.element_blocks(shape, 5, whole_rows=True)  # a row (12 elements) is larger than the limit
    assert rows == [(slice(i, i + 1),) for i in range(5)]


@pytest.mark.slow
def test_worker_processes_give_the_same_checks(tmp_path):
    path = record_case(CASES["adamw-wd-forloop"], str(tmp_path / "run.h5"))
    name = _corrupt(path)
    one = upd.verify(path)
    two = upd.verify(path, jobs=2)
    pd.testing.assert_frame_equal(two.checks, one.checks)
    assert two.exit_code == one.exit_code == 1 and name in set(two.checks[two.checks["status"] == "mismatch"]["param"])


class NormalizedSGD(torch.optim.Optimizer):
    """p -= lr * g / ||g||: each element's update reads the whole gradient's norm (not elementwise)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm(), alpha=-group["lr"])


def _normalized_sgd_rule(param, grad, state, group, step):
    return upd.replay.Replayed(param - group["lr"] * grad / grad.norm())


@pytest.mark.parametrize("declared_elementwise", [False, True], ids=["default", "wrongly-elementwise"])
def test_a_plugin_rule_gets_the_whole_tensor_unless_declared_elementwise(declared_elementwise, tmp_path,
                                                                          monkeypatch):
    # A plugin's math may read a norm: by default verify hands it the whole tensor even when blocks are tiny; a rule
    # that wrongly declares elementwise=True sees 7-element chunks, and the norm of a chunk is not the tensor's.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = NormalizedSGD(model.parameters(), lr=0.05)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=1):
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(16, 6)).pow(2).mean().backward()
            opt.step()
    upd.replay.register(NormalizedSGD, elementwise=declared_elementwise)(_normalized_sgd_rule)
    try:
        _tiny_blocks(monkeypatch)
        report = upd.verify(path)
    finally:
        upd.replay.unregister(NormalizedSGD)
    if declared_elementwise:
        assert report.mismatched > 0
    else:
        assert report.exit_code == 0 and report.mismatched == 0 and report.matched == 16
