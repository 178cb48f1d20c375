"""The README's commands are the ones CI runs and they work as written."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    quickstart = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.*?)\n```", quickstart, re.S)


def test_quickstart_has_two_commands_and_ci_runs_the_test_one():
    install_demo, tests = readme_commands()
    assert "upd demo" in install_demo and "pytest" in tests
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci_lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert tests.strip() in ci_lines
    assert ci_lines.index("python -m pip install --quiet torch==2.13.0") < ci_lines.index(tests.strip())
