"""Every optimizer x option set x implementation in tests/harness/cases: verify passes; and for each optimizer x
option set (one implementation of it), verify fails on each perturbation."""
import json

import h5py
import pytest

import upd
from upd.runfile import schema

from tests.harness.cases import all_cases
from tests.harness.replay_matrix import record_case

CASES = all_cases()


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
            has_state = (run.params()["state"] != "").any()
        assert report.checks["state_checked"].any() or not has_state or case.steps == 1


def _perturbed(case, recorded, kind, tmp_path):
    src = recorded(case)
    dst = str(tmp_path / f"{kind}.h5")
    with open(src, "rb") as a, open(dst, "wb") as b:
        b.write(a.read())
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


def perturbed_cases(cases):
    """One case per (optimizer, options, model) that verify passes: the tolerance check a perturbation trips does
    not depend on which implementation recorded the run, and every implementation is already checked by
    test_verify_passes. The implementation perturbed rotates across option sets, so each one is perturbed
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


PERTURBED = [pytest.param(c, kind, id=f"{c.id}-{kind}", marks=c.marks) for c in perturbed_cases(CASES)
             for kind in c.perturb]


@pytest.mark.parametrize("case, kind", PERTURBED)
def test_verify_fails_on_perturbation(case, kind, recorded, tmp_path):
    path, record = _perturbed(case, recorded, kind, tmp_path)
    report = upd.verify(path)
    assert report.exit_code == 1, report.summary()
    bad = report.checks[report.checks["status"] == "mismatch"]
    assert record in set(bad["record"])
