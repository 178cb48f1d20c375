"""Every optimizer x option set x implementation in tests/cases: verify passes, and fails on each perturbation."""
import json

import h5py
import pytest
import torch
from torch import nn

import upd

from cases import Case, all_cases

CASES = all_cases()


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
    with upd.record(path, model, opt, strict=True):
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


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    cache = {}

    def get(case):
        if case.id not in cache:
            cache[case.id] = record_case(case, str(tmp_path_factory.mktemp("m") / f"{case.id}.h5"))
        return cache[case.id]
    return get


def _params(case):
    return [pytest.param(c, id=c.id, marks=c.marks) for c in CASES]


@pytest.mark.parametrize("case", _params(None))
def test_verify_passes(case, recorded):
    report = upd.verify(recorded(case))
    assert report.exit_code == case.expect_exit, report.summary()
    if case.expect_exit == 3:  # refused, each step with its reason
        assert report.matched == 0 and report.mismatched == 0 and report.skipped > 0
        assert report.checks["note"].str.len().min() > 20
    if case.expect_exit == 0:
        assert report.mismatched == 0 and report.matched >= case.steps
        with upd.open_run(recorded(case)) as run:
            has_state = (run.params["state"] != "").any()
        assert report.checks["state_checked"].any() or not has_state or case.steps == 1


def _perturbed(case, recorded, kind, tmp_path):
    src = recorded(case)
    dst = str(tmp_path / f"{kind}.h5")
    with open(src, "rb") as a, open(dst, "wb") as b:
        b.write(a.read())
    with h5py.File(dst, "r+") as f:
        opt = f["optimizers/0"]
        record = 2 if case.steps > 2 else case.steps - 1
        if kind == "update":
            name = next(n for n in opt["params"] if opt["params"][n]["param"].ndim >= 3)  # a weight
            p = opt["params"][name]
            row = list(p["record"][()]).index(record)
            before, after = p["param"][row], p["param_after"][row]
            p["param_after"][row] = before + (after - before) * 1.01
        else:
            groups = json.loads(opt["records/hparams"][record])
            if kind == "lr":
                lr = groups[0]["lr"]
                groups[0]["lr"] = {"tensor": lr["tensor"] * 1.01, "dtype": lr["dtype"]} if isinstance(lr, dict) \
                    else lr * 1.01
            else:
                assert groups[0]["weight_decay"] != 0, "case lists weight_decay but has none"
                for g in groups:
                    g["weight_decay"] = 0.0
            opt["records/hparams"][record] = json.dumps(groups)
    return dst, record


PERTURBED = [pytest.param(c, kind, id=f"{c.id}-{kind}", marks=c.marks) for c in CASES if c.expect_exit == 0
             for kind in c.perturb]


@pytest.mark.parametrize("case, kind", PERTURBED)
def test_verify_fails_on_perturbation(case, kind, recorded, tmp_path):
    path, record = _perturbed(case, recorded, kind, tmp_path)
    report = upd.verify(path)
    assert report.exit_code == 1, report.summary()
    bad = report.checks[report.checks["status"] == "mismatch"]
    assert record in set(bad["record"])
