"""Loads a repository script (tools/report/*.py, bench/*.py) as a module for the Python tests,
with its own folder on sys.path while it loads (the scripts import their neighbours)."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(folder, name):
    """The module of ROOT/folder/name.py."""
    where = ROOT / folder
    sys.path.insert(0, str(where))
    try:
        spec = importlib.util.spec_from_file_location(name, where / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(where))
