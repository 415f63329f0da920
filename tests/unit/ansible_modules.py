"""Load our Ansible modules in unit tests the way Ansible ships them to a host: every file in
module_utils/ importable as ansible.module_utils.<name>, then library/<module>.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def register_module_utils() -> None:
    for path in sorted((ROOT / "module_utils").glob("*.py")):
        name = f"ansible.module_utils.{path.stem}"
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def load_module(name: str) -> ModuleType:
    register_module_utils()
    spec = importlib.util.spec_from_file_location(f"hsx_library_{name}", ROOT / "library" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
