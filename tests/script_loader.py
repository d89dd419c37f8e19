"""Import a file from scripts/ as a module, for tests."""

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name):
    """Load ``scripts/<name>.py`` by path (once per session) and return the module.

    By path rather than by putting scripts/ on sys.path: that folder holds profile.py,
    and the test session should import the standard library's modules by their names.
    """
    return load_file(name, SCRIPTS / f"{name}.py")


def load_file(name, path):
    """Load the Python file ``path`` as module ``name`` (once per session: a later call
    with the same name returns the module loaded first)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
