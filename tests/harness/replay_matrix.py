"""Record one replay-matrix case: a short real training run of a small model with the case's optimizer configuration.

Shared by tests/verify/test_replay_matrix.py (verify passes, and fails on each perturbation) and
benchmarks/verify_worst_errors.py (the worst error per optimizer, in docs/verify.md).
"""
import torch
from torch import nn

import upd
from tests.harness.cases import Case


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
