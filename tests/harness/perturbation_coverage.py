"""Proof that perturbing one implementation per (optimizer, options) loses nothing: every case's every
perturbation is run (as the replay matrix did before it perturbed one implementation of each), and the script
checks that each perturbation that was caught on some implementation is still in the matrix for its (optimizer,
options, model). Too slow for the suite (every case x every perturbation, minutes); run it after changing the cases
or the selection:

    python -m tests.harness.perturbation_coverage [out.json]
"""
import json
import pathlib
import sys
import tempfile

from tests.harness.cases import all_cases
from tests.harness.replay_matrix import PERTURBED, perturbation_caught, record_case


def main(out=None):
    cases = [c for c in all_cases() if c.expect_exit == 0]
    kept = {(c.options_id, kind) for c, kind in PERTURBED}
    caught, missed = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for number, case in enumerate(cases):
            path = record_case(case, f"{tmp}/{case.id}.h5")
            for kind in case.perturb:
                hit, _summary = perturbation_caught(case, path, kind, pathlib.Path(tmp))
                caught[f"{case.id}/{kind}"] = hit
                if hit and (case.options_id, kind) not in kept:
                    missed.append(f"{case.id}/{kind}")
            print(f"{number + 1}/{len(cases)} {case.id}", file=sys.stderr)
    result = {"perturbations_before": len(caught), "caught_before": sum(caught.values()),
              "perturbations_now": len(PERTURBED), "caught_before_and_no_longer_in_the_matrix": missed,
              "not_caught_before": sorted(k for k, v in caught.items() if not v)}
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
