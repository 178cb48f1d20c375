"""Tensors the recorder cannot store as they are, and parameters that change under it: training always goes on."""
import warnings

import pytest
import torch
from torch import nn

import upd
from upd.runfile import schema



def record_and_count_warnings(path, model, opt, steps, between=None, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(path, model, opt, **{"every": 1, **options}) as rec:
            for step in range(steps):
                if between is not None:
                    between(step)
                opt.zero_grad()
                model(torch.randn(4, model[0].in_features)).pow(2).mean().backward()
                opt.step()
    return rec, [w for w in caught if issubclass(w.category, upd.RecorderWarning)]


def test_parameter_that_changes_shape_stops_recording_once(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def grow(step):
        if step == 3:  # e.g. a vocabulary resize in place: same Parameter object, new shape
            with torch.no_grad():
                model[0].bias.data = torch.zeros(5)
                model[0].weight.data = torch.zeros(5, 6)

    path = str(tmp_path / "run.h5")
    rec, warned = record_and_count_warnings(path, model, opt, 6, between=grow)
    assert len(warned) == 1 and rec.error is not None
    assert list(model[0].bias.shape) == [5]  # training went on with the new shape
    with upd.open_run(path) as run:
        assert list(run.optimizers[0].steps) == [0, 1, 2]  # everything before the change is kept
    assert upd.verify(path).exit_code == 0


def test_strict_raises_on_a_shape_change(tmp_path):
    model = nn.Sequential(nn.Linear(6, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(Exception):
        with upd.record(str(tmp_path / "run.h5"), model, opt, strict=True, every=1):
            for step in range(3):
                if step == 2:
                    model[0].bias.data = torch.zeros(5)
                    model[0].weight.data = torch.zeros(5, 6)
                opt.zero_grad()
                model(torch.randn(4, 6)).pow(2).mean().backward()
                opt.step()


def test_meta_tensor_parameter_warns_once_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    ghost = nn.Parameter(torch.empty(3, device="meta"))  # has no data to copy
    opt = torch.optim.SGD([*model.parameters(), ghost], lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(str(tmp_path / "run.h5"), model, opt, every=1) as rec:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(4, 6)).pow(2).mean().backward()
                ghost.grad = torch.empty(3, device="meta")
                opt.step()
    warned = [w for w in caught if issubclass(w.category, upd.RecorderWarning)]
    assert len(warned) == 1 and rec.error is not None
    assert model.weight.grad is not None  # the three steps ran


def test_complex_parameters_are_recorded_and_not_falsely_verified(tmp_path):
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    opt = torch.optim.Adam([weight], lr=1e-2)
    path = str(tmp_path / "run.h5")
    with upd.record(path, optimizer=opt, every=1):
        for _ in range(3):
            opt.zero_grad()
            (weight.abs() ** 2).sum().backward()
            opt.step()
    with upd.open_run(path) as run:
        p = run.param("group0.param0")
        assert p.dtype == "complex64" and p.read("param", 0).dtype == torch.complex64
        ratios = run.ratios()
    assert len(ratios) == 3
    report = upd.verify(path)
    assert report.exit_code == 3 and report.mismatched == 0  # refused with its reason, never a false fail
    assert "complex" in report.checks["note"].iloc[0]


def test_missing_folders_are_created(tmp_path):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "runs" / "exp1" / "run.h5"  # the README's first example records into runs/
    with upd.record(str(path), model, opt, every=1):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    assert upd.open_run(str(path)).optimizers[0].num_records == 1


def test_permission_denied_warns_and_training_goes_on(tmp_path, monkeypatch):
    import h5py

    def denied(*args, **kwargs):  # root bypasses chmod here, so the refusal is injected where the file opens
        raise PermissionError(13, "Permission denied", str(tmp_path / "run.h5"))

    monkeypatch.setattr(h5py, "File", denied)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(str(tmp_path / "run.h5"), model, opt, every=1) as rec:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(2, 3)).sum().backward()
                opt.step()
    warned = [w for w in caught if issubclass(w.category, upd.RecorderWarning)]
    assert len(warned) == 1 and "Permission denied" in str(warned[0].message)
    assert isinstance(rec.error, PermissionError) and not opt._optimizer_step_pre_hooks
    with pytest.raises(PermissionError):
        upd.record(str(tmp_path / "run.h5"), model, opt, strict=True, every=1)


def test_run_file_deleted_while_recording(tmp_path):
    import os

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "run.h5")

    def delete(step):
        if step == 3:
            os.remove(path)

    rec, warned = record_and_count_warnings(path, model, opt, 6, between=delete)
    assert len(warned) == 1 and "deleted or replaced" in str(warned[0].message)
    assert rec.error is not None


# -- sparse tensors: recorded densified (the dense tensor is what the optimizer's math sees) ------------------------
LOOKUPS = torch.tensor([[1, 3, 3], [5, 1, 0]])  # rows 0, 1, 3, 5 of 10 get a gradient at every step


def train_sparse_embedding(path, make_optimizer, steps=4, **options):
    """nn.Embedding(sparse=True): dense weight, sparse gradient. Returns the recorder, its RecorderWarnings, the
    embedding and the dense gradient the optimizer saw at each step."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = make_optimizer(emb.parameters())
    grads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(path, emb, opt, **{"every": 1, **options}) as rec:
            for _ in range(steps):
                opt.zero_grad()
                emb(LOOKUPS).pow(2).sum().backward()
                assert emb.weight.grad.is_sparse
                grads.append(emb.weight.grad.to_dense().clone())
                opt.step()
    return rec, [w for w in caught if issubclass(w.category, upd.RecorderWarning)], emb, grads


SPARSE_GRAD_OPTIMIZERS = {
    "sparseadam": lambda params: torch.optim.SparseAdam(params, lr=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


@pytest.mark.parametrize("opt_name", sorted(SPARSE_GRAD_OPTIMIZERS))
def test_sparse_gradients_recorded_densified_and_verified(tmp_path, opt_name):
    import h5py

    path = str(tmp_path / "run.h5")
    rec, warned, emb, grads = train_sparse_embedding(path, SPARSE_GRAD_OPTIMIZERS[opt_name])
    assert not warned and rec.error is None
    with upd.open_run(path) as run:
        p = run.param("weight")
        assert torch.equal(p.read("grad", 2), grads[2])  # the sparse gradient, densified, exactly
        assert torch.equal(p.read("param_after", 3), emb.weight.detach())
    assert upd.verify(path).exit_code == 0
    with h5py.File(path, "r+") as f:  # negative control: one looked-up element of one update off by 1e-3
        ds = f[schema.PARAMETER.at(schema.KIND_PARAM_AFTER, k=0, name='weight')]
        row = ds[1]
        row[3, 2] += 1e-3
        ds[1] = row
    report = upd.verify(path)
    assert report.exit_code == 1
    assert set(report.checks[report.checks["status"] == "mismatch"]["step"]) == {1}


def test_sparse_gradients_in_stats_mode(tmp_path):
    path = str(tmp_path / "run.h5")
    rec, warned, _, grads = train_sparse_embedding(path, SPARSE_GRAD_OPTIMIZERS["sparseadam"], every=None,
                                                   stats_every=1)
    assert not warned and rec.error is None
    with upd.open_run(path) as run:
        stats = run.stats()
    assert list(stats["step"]) == [0, 1, 2, 3]
    # Statistics of the dense gradient: 6 of the 10 rows were not looked up, so 60% exact zeros.
    assert stats["grad_zero_frac"].tolist() == pytest.approx([0.6] * 4)
    assert stats["grad_norm"].tolist() == pytest.approx([float(g.norm()) for g in grads], rel=1e-6)
    assert (stats["update_norm"] > 0).all()


def sparse_parameter():
    torch.manual_seed(0)
    values = torch.randn(3)
    return nn.Parameter(torch.sparse_coo_tensor(torch.tensor([[0, 1, 3], [2, 0, 1]]), values, (5, 4),
                                                check_invariants=True).coalesce())


@pytest.mark.parametrize("options", [{}, {"stats_every": 1}, {"every": None, "stats_every": 1}],
                         ids=["full", "full+stats", "stats"])
def test_sparse_parameter_trained_with_sgd_recorded_densified(tmp_path, options):
    """A sparse COO parameter: of torch 2.13's optimizers only SGD accepts one (Adagrad, Adam, ... refuse it). SGD's
    update is linear, so the dense replay of the densified record is the same step."""
    import h5py

    weight = sparse_parameter()
    opt = torch.optim.SGD([weight], lr=0.1, momentum=0.9, weight_decay=0.01)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    path = str(tmp_path / "run.h5")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(path, optimizer=opt, **{"every": 1, **options}) as rec:
            for _ in range(4):
                opt.zero_grad()
                torch.sparse.mm(weight, x).pow(2).sum().backward()
                opt.step()
    assert not [w for w in caught if issubclass(w.category, upd.RecorderWarning)] and rec.error is None
    assert weight.is_sparse  # training itself is untouched
    with upd.open_run(path) as run:
        if options.get("stats_every"):
            stats = run.stats()
            assert list(stats["step"]) == [0, 1, 2, 3] and (stats["update_norm"] > 0).all()
            # The gradient of torch.sparse.mm is sparse on the parameter's 3 entries: 17 of 20 exact zeros densified.
            assert stats["grad_zero_frac"].tolist() == pytest.approx([17 / 20] * 4)
        if "every" in options:
            return
        p = run.param("group0.param0")
        assert torch.equal(p.read("param_after", 3), weight.detach().to_dense())
    assert upd.verify(path).exit_code == 0
    with h5py.File(path, "r+") as f:  # negative control: the momentum buffer the step 2 replay starts from
        ds = f[f"{schema.STATE.path(k=0, name='group0.param0')}/momentum_buffer"]
        ds[2] = ds[2] * 1.001
    report = upd.verify(path)
    assert report.exit_code == 1
    assert 2 in set(report.checks[report.checks["status"] == "mismatch"]["step"])


# -- DTensor whose local part is no slice of the whole (a Partial gradient): recording stops --------------------
def distributed_linear(mesh, placement):
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    placement = {"replicate": Replicate(), "shard0": Shard(0)}[placement]

    def partition(name, module, mesh):
        for pname, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), mesh, [placement])))

    torch.manual_seed(0)
    return distribute_module(nn.Linear(6, 4), mesh, partition)


def dtensor_input(mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    return distribute_tensor(torch.randn(5, 6), mesh, [Replicate()])


def partial_grad(param, mesh):
    """The parameter's gradient as a Partial DTensor (each rank a summand): the recorder cannot store it as a part
    of the whole gradient."""
    from torch.distributed.tensor import DTensor, Partial

    param.grad = DTensor.from_local(param.grad.to_local(), mesh, [Partial()])


@pytest.mark.parametrize("options", [{}, {"every": None, "stats_every": 1}, {"every": None, "flight_recorder": 3}],
                         ids=["full", "stats", "flight"])
@pytest.mark.parametrize("placement", ["replicate", "shard0"])
def test_dtensor_parameters_warn_once_and_training_goes_on(tmp_path, cpu_mesh, placement, options):
    from torch.distributed.tensor import DTensor

    model = distributed_linear(cpu_mesh, placement)
    assert isinstance(model.weight, DTensor)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    path = str(tmp_path / "run.h5")
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(path, model, opt, **{"every": 1, **options}) as rec:
            for _ in range(3):
                opt.zero_grad()
                model(dtensor_input(cpu_mesh)).pow(2).mean().backward()
                partial_grad(model.weight, cpu_mesh)
                opt.step()
                seen.append(model.weight.full_tensor().clone())
    warned = [w for w in caught if issubclass(w.category, upd.RecorderWarning)]
    assert len(warned) == 1 and "DTensor" in str(warned[0].message) and "weight" in str(warned[0].message)
    assert isinstance(rec.error, TypeError) and not opt._optimizer_step_pre_hooks
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])  # training went on
    with upd.open_run(path) as run:  # stopped before the first record, and the file is still a readable run
        assert run.optimizers[0].num_records == 0


def test_dtensor_parameter_added_mid_run_stops_at_that_step(tmp_path, cpu_mesh):
    """Plain parameters are recorded until a DTensor with a Partial gradient appears (add_param_group at step 3):
    the three records before stay readable and verify, the DTensor trains on unrecorded."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    extra = nn.Parameter(distribute_tensor(torch.randn(4, 2), cpu_mesh, [Shard(0)]))
    before = extra.full_tensor().clone()

    path = str(tmp_path / "run.h5")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with upd.record(path, model, opt, every=1) as rec:
            for step in range(5):
                if step == 3:
                    opt.add_param_group({"params": [extra], "lr": 0.05})
                opt.zero_grad()
                model(torch.randn(4, 6)).pow(2).mean().backward()
                extra.grad = DTensor.from_local(torch.ones(4, 2), cpu_mesh, [Partial()])
                opt.step()
    warned = [w for w in caught if issubclass(w.category, upd.RecorderWarning)]
    assert len(warned) == 1 and "DTensor" in str(warned[0].message) and rec.error is not None
    assert not torch.equal(extra.full_tensor(), before)  # the DTensor parameter trained
    with upd.open_run(path) as run:
        assert list(run.optimizers[0].steps) == [0, 1, 2]
    assert upd.verify(path).exit_code == 0


def test_strict_raises_on_a_dtensor_parameter(tmp_path, cpu_mesh):
    model = distributed_linear(cpu_mesh, "replicate")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="DTensor"):
        with upd.record(str(tmp_path / "run.h5"), model, opt, strict=True, every=1):
            opt.zero_grad()
            model(dtensor_input(cpu_mesh)).pow(2).mean().backward()
            partial_grad(model.weight, cpu_mesh)
            opt.step()
