"""Worst verify error per optimizer over the whole replay matrix (tests/harness/cases): the figures in docs/verify.md.

    python -m benchmarks.verify_worst_errors

Records every case of the matrix in a temporary folder, verifies it, and prints per optimizer the number of cases
and checks, the worst error/tolerance ratio for parameters and for state, and the case where it occurred.
"""
import os
import tempfile

import pandas as pd

import upd
from tests.harness.cases import all_cases
from tests.harness.replay_matrix import record_case


def main():
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in all_cases():
            if case.expect_exit != 0:
                continue
            report = upd.verify(record_case(case, os.path.join(tmp, f"{case.id}.h5")))
            checks = report.checks
            rows.append({"optimizer": case.id.split("-")[0], "case": case.id, "checks": len(checks),
                         "mismatched": report.mismatched, "err_to_tol": checks["err_to_tol"].max(),
                         "state_err_to_tol": checks["state_err_to_tol"].max()})
    df = pd.DataFrame(rows)
    out = []
    for opt, g in df.groupby("optimizer"):
        worst = g.loc[g["err_to_tol"].idxmax()]
        out.append({"optimizer": opt, "cases": len(g), "checks": int(g["checks"].sum()),
                    "mismatched": int(g["mismatched"].sum()), "worst err/tol": round(worst["err_to_tol"], 3),
                    "worst state err/tol": round(g["state_err_to_tol"].max(), 3), "worst case": worst["case"]})
    print(pd.DataFrame(out).to_markdown(index=False) if _has_tabulate() else pd.DataFrame(out).to_string(index=False))


def _has_tabulate():
    try:
        import tabulate  # noqa: F401
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    main()
