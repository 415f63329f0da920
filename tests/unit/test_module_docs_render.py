"""`ansible-doc -M library MODULE` renders every module from the checkout (issue 50 item 5), as a
user there runs it: the project's ansible.cfg, no collection installed. The modules name their
shared doc fragment by FQCN (hsx.recovery.attributes); ansible.cfg's collections_path ends with
collections/, whose hsx.recovery holds only that fragment (a link to doc_fragments/).

One ansible-doc process for all modules (about 1 CPU-s): a module whose docs do not render makes it
print an error and exit non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(p.stem for p in (ROOT / "library").glob("*.py"))


def test_ansible_doc_renders_every_module_from_the_checkout() -> None:
    # A user's environment: no ANSIBLE_* settings of the test run (a collections path of a built
    # collection would hide what the checkout alone does).
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["ANSIBLE_NOCOLOR"] = "1"
    ansible_doc = Path(sys.executable).with_name("ansible-doc")
    proc = subprocess.run([str(ansible_doc), "-M", "library", *MODULES], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "[ERROR]" not in proc.stderr and "[WARNING]" not in proc.stderr, proc.stderr
    shown = [line.split()[2] for line in proc.stdout.splitlines() if line.startswith("> MODULE ")]
    assert shown == MODULES, proc.stdout[:2000]


def test_the_checkouts_stand_in_collection_is_never_taken_for_a_release() -> None:
    """collections/'s hsx.recovery (only the doc fragments) says version 0.0.0: without a version
    ansible-galaxy counts it as any version, and `ansible-galaxy collection install` of a real tarball
    run in the checkout said "Nothing to do. All requested collections are already installed"."""
    import yaml

    stand_in = ROOT / "collections" / "ansible_collections" / "hsx" / "recovery"
    meta = yaml.safe_load((stand_in / "galaxy.yml").read_text())
    assert (meta["namespace"], meta["name"], meta["version"]) == ("hsx", "recovery", "0.0.0")
    assert sorted(p.name for p in stand_in.iterdir()) == ["galaxy.yml", "plugins"]
    assert (stand_in / "plugins" / "doc_fragments").resolve() == ROOT / "doc_fragments"

