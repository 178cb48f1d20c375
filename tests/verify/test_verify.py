"""upd.verify on real recorded runs: it passes on honest records and fails on every kind of tampering."""
import json

import h5py
import numpy as np
import pytest
import torch

import upd
from upd.runfile import schema
from upd.replay.engine import EXIT_MATCH, EXIT_MISMATCH, EXIT_NOTHING_VERIFIABLE, compare, elementwise_error

from tests.harness.paths import SAMPLE_RUNS
from tests.harness.training import MLP, record_run, train_steps


@pytest.mark.parametrize("path", SAMPLE_RUNS, ids=lambda p: p.rsplit("/", 1)[-1])
def test_every_sample_run_verifies(path):
    report = upd.verify(path)
    assert report.exit_code == EXIT_MATCH, report.summary()
    assert report.mismatched == 0 and report.skipped == 0 and report.matched + report.inconclusive >= 20 * 4
    # Only a step whose lr is too small to move a float32 weight by more than its rounding is inconclusive: the
    # last step of the one-cycle schedule (lr 4e-8).
    with upd.open_run(path) as run:
        lrs = run.steps().set_index("step")["lr_group0"]
    inconclusive = report.checks[report.checks["status"] == "inconclusive"]
    assert (lrs[inconclusive["step"]] < 1e-6).all()
    # The next-step state comparison ran too, and both errors sit well inside the tolerance.
    assert report.checks["state_checked"].sum() >= 19 * 4
    assert report.checks["err_to_tol"].max() < 0.5
    assert report.checks["state_err_to_tol"].max() < 0.5


OPTIMIZER_CASES = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd-momentum-dampening": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, dampening=0.3),
    "sgd-nesterov-wd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.8, nesterov=True,
                                                 weight_decay=0.01),
    "sgd-maximize": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5, maximize=True),
    "sgd-tensor-lr": lambda m: torch.optim.SGD(m.parameters(), lr=torch.tensor(0.05), momentum=0.5),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "adam-amsgrad-wd": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True, weight_decay=0.1),
    "adam-maximize": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, maximize=True, betas=(0.8, 0.99)),
    "adam-decoupled": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.1,
                                                 decoupled_weight_decay=True),
    "adam-tensor-lr": lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-2)),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "adamw-amsgrad": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True),
}


@pytest.mark.parametrize("case", sorted(OPTIMIZER_CASES))
def test_replay_matches_each_option(tmp_path, case):
    path = record_run(str(tmp_path / "run.h5"), OPTIMIZER_CASES[case], steps=5)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MATCH, report.summary()
    assert report.matched == 5 * 4


@pytest.mark.parametrize("case", ["sgd-momentum-dampening", "adam-amsgrad-wd", "adamw"])
def test_replay_rejects_a_wrong_lr(tmp_path, case):
    """Rewrite the lr the file claims for one step by 1%: the replay must no longer match that step."""
    path = record_run(str(tmp_path / "run.h5"), OPTIMIZER_CASES[case], steps=5)
    with h5py.File(path, "r+") as f:
        hp = f[schema.RECORD_TABLE.at(schema.HPARAMS, k=0)]
        groups = json.loads(hp[2])
        groups[0]["lr"] = groups[0]["lr"] * 1.01
        hp[2] = json.dumps(groups)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MISMATCH
    bad = report.checks[report.checks["status"] == "mismatch"]
    assert set(bad["step"]) == {2}
    assert len(bad) == 4  # every parameter of that step


def test_corrupted_tensor_fails_and_names_the_step(sample_copy):
    path = sample_copy("adam.h5")
    with h5py.File(path, "r+") as f:
        ds = f[schema.PARAMETER.at(schema.KIND_PARAM_AFTER, k=0, name='fc1.weight')]
        row = ds[7]
        row[3, 5] += 1e-4  # a tenth of one Adam update
        ds[7] = row
    report = upd.verify(path)
    assert report.exit_code == EXIT_MISMATCH
    bad = report.checks[report.checks["status"] == "mismatch"]
    # Row 7's update is wrong, and so is the continuity into step 8 (param at 8 != corrupted param_after at 7).
    assert set(zip(bad["param"], bad["step"])) == {("fc1.weight", 7)}
    assert "differs from the replayed" in bad["note"].iloc[0]


def test_corrupted_state_fails(sample_copy):
    path = sample_copy("sgd_momentum.h5")
    with h5py.File(path, "r+") as f:
        ds = f[f"{schema.STATE.path(k=0, name='fc2.bias')}/momentum_buffer"]
        ds[10] = ds[10] * 1.001
    report = upd.verify(path)
    assert report.exit_code == EXIT_MISMATCH
    bad = report.checks[report.checks["status"] == "mismatch"]
    # Step 9's replayed buffer no longer equals the recorded one, and step 10 replays from the corrupted buffer.
    assert set(bad["step"]) == {9, 10} and set(bad["param"]) == {"fc2.bias"}


def test_grad_scaled_after_the_recorder_hook_is_caught(tmp_path):
    """A step pre-hook registered after the recorder halves the gradient: the optimizer used other grads."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = str(tmp_path / "run.h5")
    with upd.record(path, model, opt, every=1):
        def halve(optimizer, args, kwargs):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad.mul_(0.5)
        opt.register_step_pre_hook(halve)
        train_steps(model, opt, steps=3)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MISMATCH
    assert report.mismatched == 3 * 4


def test_parameter_changed_outside_the_optimizer_is_caught(tmp_path):
    """A manual clamp after optimizer.step() is invisible to the update, but breaks continuity."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = str(tmp_path / "run.h5")

    def clamp(i):
        if i == 1:
            with torch.no_grad():
                model.fc1.weight.clamp_(-0.05, 0.05)

    with upd.record(path, model, opt, every=1):
        train_steps(model, opt, steps=4, after_step=clamp)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MISMATCH
    bad = report.checks[report.checks["status"] == "mismatch"]
    assert list(zip(bad["param"], bad["step"])) == [("fc1.weight", 1)]
    assert "outside the optimizer" in bad["note"].iloc[0]


def test_unknown_optimizer_is_nothing_verifiable(tmp_path):
    class Lion(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-3):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.sign(), alpha=-group["lr"])

    path = record_run(str(tmp_path / "run.h5"), lambda m: Lion(m.parameters(), lr=1e-3), steps=2)
    report = upd.verify(path)
    assert report.exit_code == EXIT_NOTHING_VERIFIABLE
    assert "Lion" in report.problems[0] and "no replay rule" in report.problems[0]

    # A rule registered for it makes the same file verifiable.
    @upd.replay.register(Lion)
    def lion(param, grad, state, group, step):
        return upd.replay.Replayed(param - group["lr"] * grad.sign())

    try:
        assert upd.verify(path).exit_code == EXIT_MATCH
        # and a rule with the wrong math is caught
        upd.replay.register(Lion)(lambda param, grad, state, group, step: upd.replay.Replayed(
            param - 1.01 * group["lr"] * grad.sign()))
        assert upd.verify(path).exit_code == EXIT_MISMATCH
    finally:
        upd.replay.unregister(Lion)


def test_without_state_only_the_first_step_is_verifiable(tmp_path):
    path = record_run(str(tmp_path / "run.h5"), OPTIMIZER_CASES["adam"], steps=3, what=("param", "grad"))
    report = upd.verify(path)
    assert report.exit_code == EXIT_MATCH
    assert report.matched == 4 and report.skipped == 2 * 4
    assert report.checks[report.checks["status"] == "skipped"]["note"].str.contains("state not recorded").all()


def test_error_measure_treats_matching_nans_and_infs_as_equal():
    a = torch.tensor([1.0, float("nan"), float("inf"), 2.0], dtype=torch.float64)
    b = torch.tensor([1.0, float("nan"), float("inf"), float("nan")], dtype=torch.float64)
    assert elementwise_error(a, b).tolist() == [0.0, 0.0, 0.0, float("inf")]
    _, ratio = compare(a[:3], b[:3], 1.0, eps=1e-7, ulps=2, rtol=1e-5)
    assert ratio == 0.0


def test_tolerance_is_tight(tmp_path):
    """An error of 10x the tolerance's relative part must fail, 0.1x must pass: the bound is not loose."""
    path = record_run(str(tmp_path / "run.h5"), OPTIMIZER_CASES["adam"], steps=2)
    run = upd.open_run(path)
    p = run.param("fc1.weight")
    before, after = p.read("param", 1).double(), p.read("param_after", 1).double()
    scale = float((after - before).abs().max())
    run.close()
    for factor, passes in ((0.1, True), (10.0, False)):
        shifted = after.clone()
        shifted[0, 0] += factor * 1e-5 * scale + 4 * np.finfo(np.float32).eps * abs(float(after[0, 0]))
        _, ratio = compare(shifted, after, scale, eps=float(np.finfo(np.float32).eps), ulps=2, rtol=1e-5)
        assert (ratio <= 1.0) == passes, (factor, ratio)


def test_rules_are_chosen_by_the_torch_version_that_wrote_the_file(sample_copy):
    """A rule limited to older torch versions is used for files those versions wrote, and only for them."""
    path = sample_copy("sgd_momentum.h5")

    def old_sgd(param, grad, state, group, step):  # a deliberately different "old" algorithm
        return upd.replay.Replayed(param - 2 * group["lr"] * grad)

    upd.replay.register(torch.optim.SGD, torch_below="2.0")(old_sgd)
    try:
        assert upd.replay.lookup("torch.optim.SGD", torch_version="1.13.1").fn is old_sgd
        assert upd.replay.lookup("torch.optim.SGD", torch_version="2.13.0+cpu").fn is not old_sgd
        assert upd.verify(path).exit_code == EXIT_MATCH  # written by torch 2.13: the current rule
        with h5py.File(path, "r+") as f:
            meta = json.loads(f.attrs["meta"])
            meta["torch_version"] = "1.13.1"
            f.attrs["meta"] = json.dumps(meta)
        assert upd.verify(path).exit_code == EXIT_MISMATCH  # now replayed with the old rule
    finally:
        from upd.replay import registry
        registry._RULES["torch.optim.SGD"] = [r for r in registry._RULES["torch.optim.SGD"] if r.fn is not old_sgd]
    assert upd.verify(path).exit_code == EXIT_MATCH


def test_one_element_tensor_lr_verifies_and_a_corruption_still_fails(tmp_path):
    """torch accepts lr=torch.tensor([0.1]) (shape (1,)); the rule gets the plain float, not a one-element list."""
    path = record_run(str(tmp_path / "run.h5"), lambda m: torch.optim.SGD(m.parameters(), lr=torch.tensor([0.1]),
                                                                          momentum=0.5), steps=3)
    report = upd.verify(path)
    assert report.exit_code == EXIT_MATCH, report.summary()
    assert report.matched == 3 * 4
    with h5py.File(path, "r+") as f:
        ds = f[schema.PARAMETER.at(schema.KIND_PARAM_AFTER, k=0, name='fc1.weight')]
        ds[1] = ds[1] * 1.01
    report = upd.verify(path)
    assert report.exit_code == EXIT_MISMATCH
    bad = report.checks[report.checks["status"] == "mismatch"]
    assert set(zip(bad["param"], bad["step"])) == {("fc1.weight", 1)}


def test_an_exception_inside_a_rule_is_a_rule_failure_naming_rule_step_and_parameter(sample_copy):
    """A bug in a replay rule is not a broken file: ReplayRuleError (CLI exit 4), naming the rule, step, param."""
    path = sample_copy("sgd_momentum.h5")

    def broken_sgd(param, grad, state, group, step):
        if step == 2:
            return 1 / 0  # a rule's own bug
        return upd.replay.Replayed(param - group["lr"] * grad)

    upd.replay.register(torch.optim.SGD, torch_below="99")(broken_sgd)
    try:
        with pytest.raises(upd.replay.ReplayRuleError) as exc:
            upd.verify(path)
        message = str(exc.value)
        assert "\n" not in message
        assert "broken_sgd" in message and "ZeroDivisionError" in message
        assert "step 2" in message and "'fc1.weight'" in message and path in message
        assert not isinstance(exc.value, upd.RunFileError)
    finally:
        from upd.replay import registry
        registry._RULES["torch.optim.SGD"] = [r for r in registry._RULES["torch.optim.SGD"]
                                              if r.fn is not broken_sgd]
    assert upd.verify(path).exit_code == EXIT_MATCH


def test_a_hyperparameter_missing_from_the_record_is_still_an_unusable_file(sample_copy):
    """What the file lacks stays the file's fault (RunFileError, exit 2), even though the rule is what reads it."""
    path = sample_copy("adam.h5")
    with h5py.File(path, "r+") as f:
        hp = f[schema.RECORD_TABLE.at(schema.HPARAMS, k=0)]
        groups = json.loads(hp[2])
        del groups[0]["betas"]
        hp[2] = json.dumps(groups)
    with pytest.raises(upd.RunFileError, match="betas"):
        upd.verify(path)


@pytest.mark.parametrize("option", ["rtol", "ulps"])
@pytest.mark.parametrize("value", [-1.0, -1e-9, float("nan"), float("inf")])
def test_a_negative_or_nan_tolerance_is_refused(option, value):
    with pytest.raises(ValueError, match=option):
        upd.verify(SAMPLE_RUNS[0], **{option: value})


class SignMomentum(torch.optim.Optimizer):
    """A third-party optimizer that keeps a torch-style step counter and a decaying lr in its state."""

    def __init__(self, params, lr=1e-2, beta=0.9):
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=torch.tensor(0.0), buf=torch.zeros_like(p), lr_now=torch.tensor(group["lr"]))
                state["step"] += 1
                state["buf"].mul_(group["beta"]).add_(p.grad)
                p.add_(state["buf"].sign(), alpha=-float(state["lr_now"]))
                state["lr_now"] = state["lr_now"] / state["step"]


def _sign_momentum_math(param, grad, buf, lr_now, step, beta):
    buf = beta * buf + grad
    return param - lr_now * buf.sign(), buf, lr_now / (step + 1)


def test_rules_written_for_the_documented_signature_keep_working(tmp_path):
    """A rule that unpacks its own state and counter, as docs/verify.md used to show, still verifies."""
    path = record_run(str(tmp_path / "run.h5"), lambda m: SignMomentum(m.parameters()), steps=4)

    @upd.replay.register(SignMomentum)
    def undeclared(param, grad, state, group, step):
        if state:
            buf, lr_now, done = state["buf"], float(state["lr_now"]), int(state["step"])
        else:
            buf, lr_now, done = torch.zeros_like(param), group["lr"], 0
        param, buf, lr_now = _sign_momentum_math(param, grad, buf, lr_now, done, group["beta"])
        return upd.replay.Replayed(param, {"step": torch.tensor(float(done + 1), dtype=torch.float64), "buf": buf,
                                           "lr_now": torch.tensor(lr_now, dtype=torch.float64)})

    try:
        report = upd.verify(path)
        assert report.exit_code == EXIT_MATCH, report.summary()
        assert report.matched == 4 * 4 and report.checks["state_checked"].sum() == 3 * 4
    finally:
        upd.replay.unregister(SignMomentum)


def test_declared_state_and_step_counter_are_handled_by_the_registry(tmp_path):
    """state= creates the entries on the first step, counts_steps hands the counter over and stores step + 1;
    a number in the replayed state is stored as a tensor. Wrong math in the same rule still fails."""
    path = record_run(str(tmp_path / "run.h5"), lambda m: SignMomentum(m.parameters()), steps=4)
    seen_steps = []

    def declared(param, grad, state, group, step, *, off=1.0):
        assert "step" not in state and isinstance(step, int)
        seen_steps.append(step)
        param, buf, lr_now = _sign_momentum_math(param, grad, state["buf"], float(state["lr_now"]), step,
                                                 group["beta"])
        return upd.replay.Replayed(param, {"buf": buf, "lr_now": lr_now * off, "unkept": None})

    spec = {"buf": upd.replay.zeros, "lr_now": lambda param, group: group["lr"],
            "never": upd.replay.kept_when(lambda param, group: False)}
    upd.replay.register(SignMomentum, state=spec, counts_steps=True)(declared)
    try:
        report = upd.verify(path)
        assert report.exit_code == EXIT_MATCH, report.summary()
        assert report.checks["state_checked"].sum() == 3 * 4
        assert sorted(set(seen_steps)) == [0, 1, 2, 3]
        upd.replay.register(SignMomentum, state=spec, counts_steps=True)(
            lambda *args: declared(*args, off=1.001))
        report = upd.verify(path)
        assert report.exit_code == EXIT_MISMATCH
        assert (report.checks[report.checks["status"] == "mismatch"]["note"]
                .str.contains("next record's optimizer state differs").all())
    finally:
        upd.replay.unregister(SignMomentum)


def test_a_record_lacking_declared_state_is_skipped_not_failed(sample_copy):
    path = sample_copy("adam.h5")
    with h5py.File(path, "r+") as f:
        present = f[schema.PARAMETER.at(schema.STATE_PRESENT, k=0, name='fc2.bias')]
        keys = json.loads(f[schema.STATE.path(k=0, name='fc2.bias')].attrs["keys"])
        rows = present[()]
        rows[5, keys.index("exp_avg_sq")] = 0
        present[...] = rows
    report = upd.verify(path)
    skipped = report.checks[report.checks["status"] == "skipped"]
    assert list(zip(skipped["param"], skipped["step"])) == [("fc2.bias", 5)]
    assert skipped["note"].iloc[0] == "state lacks exp_avg_sq"


def test_a_declared_state_entry_of_another_shape_is_an_unusable_file(sample_copy):
    """The rule fails on it, but the record is at fault: RunFileError (exit 2), not a rule failure."""
    path = sample_copy("adam.h5")
    with h5py.File(path, "r+") as f:
        name = f"{schema.STATE.path(k=0, name='fc2.bias')}/exp_avg"
        data, attrs = f[name][()], dict(f[name].attrs)
        del f[name]
        f.create_dataset(name, data=data[:, :7], maxshape=(None, 7))
        f[name].attrs.update(attrs)
    with pytest.raises(upd.RunFileError, match=r"state 'exp_avg' has shape \(7,\)"):
        upd.verify(path)


@pytest.mark.parametrize("counter", [float("nan"), -3.0, float("inf")])
def test_a_step_counter_that_is_not_a_count_is_an_unusable_file(sample_copy, counter):
    path = sample_copy("adam.h5")
    with h5py.File(path, "r+") as f:
        f[f"{schema.STATE.path(k=0, name='fc1.weight')}/step"][4] = counter
    with pytest.raises(upd.RunFileError, match="step counter"):
        upd.verify(path)


def test_when_a_rule_raises_the_adapter_blames_the_record_only_for_what_the_rule_declared():
    """Adam declares exp_avg shaped like the parameter: a recorded one of another shape is the file's fault
    (UnusableRecord), while the same exception on well-shaped state is the rule's own."""
    from upd.replay.registry import UnusableRecord

    rule = upd.replay.lookup("torch.optim.Adam")
    param, grad = torch.ones(10, dtype=torch.float64), torch.ones(10, dtype=torch.float64)
    group = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    good = {"step": torch.tensor([3.0]), "exp_avg": torch.zeros(10), "exp_avg_sq": torch.zeros(10)}
    assert rule.replay(param, grad, good, group, 3).state["step"].item() == 4.0
    with pytest.raises(UnusableRecord, match=r"state 'exp_avg' has shape \(7,\)"):
        rule.replay(param, grad, dict(good, exp_avg=torch.zeros(7)), group, 3)
    with pytest.raises(UnusableRecord, match="'betas'"):
        rule.replay(param, grad, good, {k: v for k, v in group.items() if k != "betas"}, 3)

    def buggy(param, grad, state, group, step):
        raise RuntimeError("a bug")

    upd.replay.register("tests.Buggy", state={"exp_avg": upd.replay.zeros})(buggy)
    try:
        with pytest.raises(RuntimeError, match="a bug") as exc:
            upd.replay.lookup("tests.Buggy").replay(param, grad, {"exp_avg": torch.zeros(10)}, group, 3)
        assert not isinstance(exc.value, UnusableRecord)
    finally:
        upd.replay.unregister("tests.Buggy")
