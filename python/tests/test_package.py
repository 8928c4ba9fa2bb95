"""The package itself: typing files shipped, stubs in step with the extension, torch optional."""

import ast
import os
import subprocess
import sys

import ioattn


def package_file(name):
    return os.path.join(os.path.dirname(ioattn.__file__), name)


def test_typing_files_are_installed():
    assert os.path.isfile(package_file("py.typed"))
    assert os.path.isfile(package_file("_C.pyi"))


def test_stub_lists_every_extension_function():
    with open(package_file("_C.pyi")) as f:
        tree = ast.parse(f.read())
    stub = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    runtime = {n for n in dir(ioattn._C) if not n.startswith("_")}
    assert stub == runtime


def test_public_names():
    for name in ioattn.__all__:
        assert hasattr(ioattn, name), name


def test_import_does_not_import_torch():
    code = "import sys, ioattn; assert 'torch' not in sys.modules; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_ioattn_torch_without_torch_is_a_clear_import_error():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "import ioattn\n"
        "try:\n"
        "    ioattn.torch\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ioattn.torch needs PyTorch" in r.stdout
