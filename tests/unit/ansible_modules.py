"""Load our Ansible modules in unit tests the way Ansible ships them to a host: the core package
module_utils/hsx importable as ansible.module_utils.hsx (its own copy, not the installed `hsx`),
then library/<module>.py; and the collection hsx.recovery generated from them (tools/collection/build.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def register_module_utils() -> None:
    """module_utils/ as a folder of ansible.module_utils, so `ansible.module_utils.hsx.<module>`
    imports module_utils/hsx/<module>.py (relative imports inside it resolve there too)."""
    import ansible.module_utils

    path = str(ROOT / "module_utils")
    if path not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(path)


def load_module(name: str) -> ModuleType:
    register_module_utils()
    spec = importlib.util.spec_from_file_location(f"hsx_library_{name}", ROOT / "library" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build_collection(out: Path) -> Path:
    """The collection generated under `out` (OUT/ansible_collections/hsx/recovery); returns `out`,
    the collections path to give ansible (ANSIBLE_COLLECTIONS_PATH)."""
    spec = importlib.util.spec_from_file_location("hsx_collection_build", ROOT / "tools" / "collection" / "build.py")
    build = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = build
    spec.loader.exec_module(build)
    build.build(out)
    return out
