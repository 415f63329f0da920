#!/usr/bin/env python3
"""Dynamic inventory: the lab's hosts (tests/lab/lab.py; powered-off ones too), group `lab`, in `extraction_nodes`.

Set HSX_LAB_ID to address a separate lab running beside the default one.
"""

import importlib.util
import json
import sys
from pathlib import Path

_LAB = Path(__file__).resolve().parents[2] / "tests" / "lab" / "lab.py"
_spec = importlib.util.spec_from_file_location("hsx_lab", _LAB)
lab = importlib.util.module_from_spec(_spec)
sys.modules["hsx_lab"] = lab
_spec.loader.exec_module(lab)

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--host":
        print("{}")
    else:
        print(json.dumps(lab.inventory_data()))
