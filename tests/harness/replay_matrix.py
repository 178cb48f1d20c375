"""The replay matrix: record one case (a short real training run of a small model with the case's optimizer
configuration), check that verify passes on it, and that each perturbation of it makes verify fail.

Every optimizer x option set x implementation in tests/harness/cases: verify passes; for each optimizer x option
set (one implementation of it), verify fails on each perturbation. The test files tests/verify/test_replay_matrix_*.py
run a few case modules each, so that pytest-xdist's workers share the matrix (--dist loadfile keeps a file on one
worker). Also used by benchmarks/verify_worst_errors.py (the worst error per optimizer, in docs/verify.md) and
tests/harness/perturbation_coverage.py (the proof that perturbing one implementation loses nothing).
"""
import json
import shutil

import h5py
import pytest
import torch
from torch import nn

import upd
from upd.runfile import schema
from tests.harness.cases import Case, all_cases


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).flatten(1))


class AttentionBlock(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, num_heads=2, batch_first=True)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        h = self.norm(x)
        return self.head((x + self.attn(h, h, h, need_weights=False)[0]).mean(1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class SparseEmbeddingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6, sparse=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(self.emb(x).mean(1))


MODELS = {
    "mlp": (MLP, lambda g: torch.randn(8, 6, generator=g)),
    "conv": (ConvNet, lambda g: torch.randn(8, 2, 4, 4, generator=g)),
    "attention": (AttentionBlock, lambda g: torch.randn(8, 5, 8, generator=g)),
    "sparse": (SparseEmbeddingModel, lambda g: torch.randint(0, 20, (8, 4), generator=g)),
}


def record_case(case: Case, path: str) -> str:
    torch.manual_seed(0)
    model_cls, make_x = MODELS["sparse" if case.sparse else case.model]
    model = model_cls()
    weights = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": weights}, {"params": others}] if case.two_groups and others else [
        {"params": list(model.parameters())}]
    if case.sparse:  # SparseAdam takes sparse-gradient parameters only
        groups = [{"params": [model.emb.weight]}]
    opt = case.make(groups)
    if case.two_groups and len(opt.param_groups) > 1:
        opt.param_groups[1]["lr"] = opt.param_groups[1]["lr"] * 0.5
    g = torch.Generator().manual_seed(1)
    with upd.record(path, model, opt, strict=True, every=1):
        for _ in range(case.steps):
            x, y = make_x(g), torch.randn(8, 3, generator=g)

            def closure():
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            if case.closure:
                opt.step(closure)
            else:
                closure()
                opt.step()
    return path


def perturbed_cases(cases):
    """One case per (optimizer, options, model) that verify passes: the tolerance check a perturbation trips does
    not depend on which implementation recorded the run, and every implementation is already checked by
    check_verify_passes. The implementation perturbed rotates across option sets, so each one is perturbed
    somewhere."""
    groups = {}
    for c in cases:
        if c.expect_exit == 0:
            groups.setdefault(c.options_id, []).append(c)
    chosen = []
    for number, group in enumerate(groups.values()):
        assert len({c.perturb for c in group}) == 1, f"{group[0].options_id}: implementations perturbed differently"
        chosen.append(group[number % len(group)])
    return chosen


PERTURBED = [(c, kind) for c in perturbed_cases(all_cases()) for kind in c.perturb]  # chosen over the whole matrix


def passes_params(cases):
    return [pytest.param(c, id=c.id, marks=c.marks) for c in cases]


def perturbation_params(cases):
    ids = {c.id for c in cases}
    return [pytest.param(c, kind, id=f"{c.id}-{kind}", marks=c.marks) for c, kind in PERTURBED if c.id in ids]


def recorded_cases(tmp_path_factory):
    """case -> the path of its recording, each case recorded once per test module."""
    cache = {}

    def get(case):
        if case.id not in cache:
            cache[case.id] = record_case(case, str(tmp_path_factory.mktemp("m") / f"{case.id}.h5"))
        return cache[case.id]
    return get


def check_verify_passes(case, path) -> None:
    report = upd.verify(path)
    assert report.exit_code == case.expect_exit, report.summary()
    if case.expect_exit == 3:  # refused, each step with its reason
        assert report.matched == 0 and report.mismatched == 0 and report.skipped > 0
        assert report.checks["note"].str.len().min() > 20
    if case.expect_exit == 0:
        assert report.mismatched == 0 and report.matched >= case.steps
        with upd.open_run(path) as run:
            has_state = (run.params()["state"] != "").any()
        assert report.checks["state_checked"].any() or not has_state or case.steps == 1


def perturbed(case, src: str, kind: str, folder) -> tuple[str, int]:
    """A copy of the recording `src` in `folder` with one perturbation; returns (its path, the record perturbed)."""
    dst = str(folder / f"{kind}.h5")
    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        params = f[schema.PARAMS_GROUP.path(k=0)]
        hparams = f[schema.RECORD_TABLE.at(schema.HPARAMS, k=0)]
        record = 2 if case.steps > 2 else case.steps - 1
        if kind == "update":
            name = next(n for n in params if params[n][schema.KIND_PARAM].ndim >= 3)  # a weight
            p = params[name]
            row = list(p[schema.RECORD_INDEX][()]).index(record)
            before, after = p[schema.KIND_PARAM][row], p[schema.KIND_PARAM_AFTER][row]
            p[schema.KIND_PARAM_AFTER][row] = before + (after - before) * 1.01
        else:
            groups = json.loads(hparams[record])
            if kind == "lr":
                lr = groups[0]["lr"]
                groups[0]["lr"] = {"tensor": lr["tensor"] * 1.01, "dtype": lr["dtype"]} if isinstance(lr, dict) \
                    else lr * 1.01
            else:
                assert groups[0]["weight_decay"] != 0, "case lists weight_decay but has none"
                for g in groups:
                    g["weight_decay"] = 0.0
            hparams[record] = json.dumps(groups)
    return dst, record


def perturbation_caught(case, src: str, kind: str, folder) -> tuple[bool, str]:
    """(verify failed, naming the perturbed record among its mismatches; its summary)."""
    path, record = perturbed(case, src, kind, folder)
    report = upd.verify(path)
    bad = report.checks[report.checks["status"] == "mismatch"]
    return report.exit_code == 1 and record in set(bad["record"]), report.summary()


def matrix_tests(cases) -> tuple:
    """(the `recorded` fixture, test_verify_passes, test_verify_fails_on_perturbation) for `cases`, for a test module
    to bind at module level: one module per group of optimizers, since xdist's --dist loadfile runs a module on one
    worker and the whole matrix on one would be the suite's longest tail."""
    @pytest.fixture(scope="module")
    def recorded(tmp_path_factory):
        return recorded_cases(tmp_path_factory)

    @pytest.mark.parametrize("case", passes_params(cases))
    def test_verify_passes(case, recorded):
        check_verify_passes(case, recorded(case))

    @pytest.mark.parametrize("case, kind", perturbation_params(cases))
    def test_verify_fails_on_perturbation(case, kind, recorded, tmp_path):
        caught, summary = perturbation_caught(case, recorded(case), kind, tmp_path)
        assert caught, summary

    return recorded, test_verify_passes, test_verify_fails_on_perturbation
