"""A script of scripts/ imported as a module, for the tests that call its functions or its main()."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(file_name: str) -> ModuleType:
    """scripts/<file_name> run as a module of its own name, registered in sys.modules (dataclasses look their
    module up there)."""
    name = Path(file_name).stem
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / file_name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
