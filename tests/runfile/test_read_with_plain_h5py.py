"""The run file needs no upd to read: the seed question's Adam step, recomputed by hand from plain h5py reads."""
from __future__ import annotations

import h5py
import torch
from torch import nn

import upd


# -- the seed answer, reproduced from the file with plain h5py -------------------------------------------------------
def test_seed_answer_adam_step_recomputed_by_hand_from_plain_h5py(tmp_path):
    path = tmp_path / "seed.h5"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 20), nn.ReLU(), nn.Linear(20, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 10)
    with upd.record(path, model, opt, every=1):
        for _ in range(5):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    step = 2
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    with h5py.File(path, "r") as f:
        assert list(f["optimizers/0/records/step"][()]) == [0, 1, 2, 3, 4]
        for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
            grp = f[f"optimizers/0/params/{name}"]
            records = list(grp["record"][()])
            row, nxt = records.index(step), records.index(step + 1)
            w = torch.from_numpy(grp["param"][row])
            g = torch.from_numpy(grp["grad"][row])
            m_old = torch.from_numpy(grp["state/exp_avg"][row])
            v_old = torch.from_numpy(grp["state/exp_avg_sq"][row])
            assert float(grp["state/step"][row]) == step
            m = b1 * m_old + (1 - b1) * g
            v = b2 * v_old + (1 - b2) * g.pow(2)
            m_hat = m.div(1 - b1 ** (step + 1))
            v_hat = v.div(1 - b2 ** (step + 1))
            w_new = w - lr * m_hat / (torch.sqrt(v_hat) + eps)
            assert torch.allclose(w_new, torch.from_numpy(grp["param"][nxt])), name
            assert torch.allclose(w_new, torch.from_numpy(grp["param_after"][row])), name
            # and the update is not trivially small compared with allclose's tolerance
            assert not torch.allclose(w, w_new, rtol=0, atol=1e-5), name
