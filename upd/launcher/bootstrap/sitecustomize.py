"""Imported by Python at the start of every process that ``upd record`` starts (this directory is first on
PYTHONPATH): when the process imports torch, torch-upd's global optimizer hooks are installed in it.

Nothing is imported here beyond the standard library, and nothing at all when the recording request is absent: most
processes of a training job (shell helpers, the torchrun agent, data loader workers) never train. The hooks
themselves load only after torch has finished importing, and ``upd`` only at the first optimizer step. Then the
``sitecustomize`` this one hides on the path (a distribution's or a virtual environment's) runs, as it would have
without torch-upd.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_LAUNCHER = os.path.dirname(_HERE)


def _load(name):
    """A module of upd/launcher loaded by its file, without importing the ``upd`` package (it imports torch)."""
    qualified = f"_upd_launcher_{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    spec = importlib.util.spec_from_file_location(qualified, os.path.join(_LAUNCHER, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module


def _install_hooks():
    try:
        _load("global_hooks").install(os.environ[_load("env").ENV_VAR])
    except Exception as exc:  # the user's program runs on, unrecorded
        print(f"torch-upd: upd record cannot hook into this process ({type(exc).__name__}: {exc}); it runs "
              "unrecorded", file=sys.stderr)


class _AfterTorchImport:
    """A meta path finder that finds nothing itself: it lets the other finders find torch, and has the hooks
    installed when torch's own import has finished (installing them earlier would see a half-made torch)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once, and so that the lookup below does not come back here
        try:
            spec = importlib.util.find_spec("torch")
        except Exception:
            return None  # the other finders are asked again, by the import itself, and report what they find
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            _install_hooks()
        spec.loader.exec_module = exec_then_install
        return spec


def _same_directory(entry):
    try:
        return os.path.samefile(entry or os.curdir, _HERE)
    except OSError:
        return False


def _run_hidden_sitecustomize():
    """Run the sitecustomize that would have been imported without this directory on the path. Its errors reach
    Python's site module, which reports them as it would have."""
    spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [entry for entry in sys.path if not _same_directory(entry)])
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    if os.environ.get(_load("env").ENV_VAR):
        if "torch" in sys.modules:  # imported by a .pth file before site got here
            _install_hooks()
        else:
            sys.meta_path.insert(0, _AfterTorchImport())
except Exception as _exc:
    print(f"torch-upd: upd record cannot hook into this process ({type(_exc).__name__}: {_exc}); it runs "
          "unrecorded", file=sys.stderr)
_run_hidden_sitecustomize()
