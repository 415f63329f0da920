"""Issue #50: `hsx recover|takeover|provision|rollout-patch|fleet-status` from an installed hsx (the
hsx-control wheel in the execution environment: no checkout) took their playbooks from the checkout
(`REPO/playbooks/...`, REPO two folders above the package) and refused ("playbooks/recover.yml does not
exist"). extraction/fleet/collection.py is the one answer: the checkout when hsx runs from one, else the
installed hsx.recovery where ansible-core looks (its order), by FQCN; neither: exit 2 naming the places.

The collection is the real one: tools/collection/build.py's tarball, installed by ansible-galaxy (about
3 s, once). The end-to-end run puts hsx's packages outside the checkout, as a wheel would, and runs
`hsx recover --check` on an inventory whose target group is empty: ansible-playbook loads all of
hsx.recovery.recover from the installed collection (its roles and filters resolve at load) and its first
play stops at the target check on localhost, touching nothing; and `hsx fleet-status`, whose module
hsx.recovery.extraction_status_info runs on localhost against a folder that does not exist."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

from extraction.fleet import collection as coll_mod
from extraction.fleet import playbook
from extraction.fleet.collection import OperatorError, installed_reports, locate, search_roots
from extraction.selfheal.remedy import INSTALLED_PLAYBOOKS, INSTALLED_VERIFY_PLAYBOOK

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SHIPPED = ("recover.yml", "takeover.yml", "provision.yml", "rollout_patch.yml")  # hsx's playbook commands


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The tarball built from this checkout, installed into a fresh collections path; that path."""
    spec = importlib.util.spec_from_file_location("hsx_collection_build", ROOT / "tools" / "collection" / "build.py")
    build = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, build)
    spec.loader.exec_module(build)
    work = tmp_path_factory.mktemp("coll")
    tarball = build.build_tarball(build.build(work / "src", check_changelog=False), work / "dist")
    with tarfile.open(tarball) as tar:
        assert {f"playbooks/{p}" for p in SHIPPED} <= set(tar.getnames())
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    # away from the checkout (its ansible.cfg's collections path has an hsx.recovery: the install a no-op)
    subprocess.run([str(BIN / "ansible-galaxy"), "collection", "install", "--offline", "--force", "-p",
                    str(work / "collections"), str(tarball)], check=True, capture_output=True, cwd=work, env=env)
    return work / "collections"


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """No ansible.cfg anywhere ansible-core looks but /etc; a home of its own; returns an empty 'lib'
    folder, where an installed package's REPO (parents[2]) lands."""
    for var in [v for v in os.environ if v.startswith("ANSIBLE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    (tmp_path / "lib").mkdir()
    return tmp_path / "lib"


def fake_collection(root: Path, playbooks=SHIPPED) -> Path:
    coll = root / "ansible_collections" / "hsx" / "recovery"
    (coll / "playbooks").mkdir(parents=True)
    for name in playbooks:
        (coll / "playbooks" / name).write_text("---\n")
    return coll


def test_a_checkout_runs_its_own_playbooks_by_path_as_before() -> None:
    src = locate(ROOT, "recover.yml")
    assert src.checkout == ROOT and src.playbook("recover.yml") == str(ROOT / "playbooks" / "recover.yml")
    assert src.module("extraction_status_info") == "extraction_status_info" and src.project_dir() == ROOT
    env = src.env()
    assert env["ANSIBLE_CONFIG"] == str(ROOT / "ansible.cfg") and env["ANSIBLE_ROLES_PATH"] == str(ROOT / "roles")
    assert env["ANSIBLE_LIBRARY"] == str(ROOT / "library") and "ANSIBLE_COLLECTIONS_PATH" not in env
    assert playbook.REPORTS == ROOT / "reports"
    with pytest.raises(OperatorError, match=r"playbooks/nope.yml does not exist: this checkout"):
        locate(ROOT, "nope.yml")


def test_installed_the_collection_from_the_tarball_runs_by_fqcn(installed, elsewhere, monkeypatch) -> None:
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_PATH", str(installed))
    for name in SHIPPED:
        src = locate(elsewhere, name, path=[])
        assert src.checkout is None and src.collection == installed / "ansible_collections" / "hsx" / "recovery"
        assert src.playbook(name) == f"hsx.recovery.{name[:-4]}"
    # the names self-healing runs installed are the same
    assert {src.playbook(f"{k}.yml") for k in INSTALLED_PLAYBOOKS} == set(INSTALLED_PLAYBOOKS.values())
    assert src.playbook("selfheal_verify.yml") == INSTALLED_VERIFY_PLAYBOOK
    assert src.module("extraction_status_info") == "hsx.recovery.extraction_status_info"
    assert src.describe().startswith(f"hsx.recovery {coll_mod.collection_version(src.collection)} installed at ")
    assert src.describe() != "hsx.recovery ? installed at"
    env = src.env()
    assert env["ANSIBLE_COLLECTIONS_PATH"] == str(installed) and src.project_dir() == elsewhere.parent / "cwd"
    assert not {"ANSIBLE_CONFIG", "ANSIBLE_LIBRARY", "ANSIBLE_ROLES_PATH", "ANSIBLE_MODULE_UTILS"} & set(env)


def test_the_search_follows_ansible_core_and_the_first_found_wins(elsewhere, tmp_path, monkeypatch) -> None:
    home_coll = fake_collection(tmp_path / "home" / ".ansible" / "collections")
    site = tmp_path / "site-packages"
    site_coll = fake_collection(site)
    assert locate(elsewhere, "recover.yml", path=[str(site)]).collection == home_coll  # default path first
    monkeypatch.setenv("ANSIBLE_HOME", str(tmp_path / "nohome"))
    assert locate(elsewhere, "recover.yml", path=[str(site)]).collection == site_coll  # then sys.path
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_SCAN_SYS_PATH", "false")
    with pytest.raises(OperatorError):
        locate(elsewhere, "recover.yml", path=[str(site)])
    monkeypatch.delenv("ANSIBLE_COLLECTIONS_SCAN_SYS_PATH")
    # the operator's ansible.cfg (here ./ansible.cfg): a relative collections_path is the file's folder's
    cfg_coll = fake_collection(tmp_path / "cwd" / "mine")
    (tmp_path / "cwd" / "ansible.cfg").write_text("[defaults]\ncollections_path = mine/ansible_collections ; mine\n")
    src = locate(elsewhere, "takeover.yml", path=[str(site)])
    assert src.collection == cfg_coll and src.env()["ANSIBLE_CONFIG"] == str(tmp_path / "cwd" / "ansible.cfg")
    assert src.env()["ANSIBLE_COLLECTIONS_PATH"] == str(tmp_path / "cwd" / "mine")
    # the environment over the file; the older variable's name too (ansible-core before 2.19)
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_PATHS", f"{tmp_path / 'nowhere'}:{tmp_path / 'home/.ansible/collections'}")
    assert locate(elsewhere, "recover.yml", path=[str(site)]).collection == home_coll
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_PATH", str(site))
    assert locate(elsewhere, "recover.yml", path=[]).collection == site_coll
    roots = search_roots(path=[])
    assert [str(r) for r, _ in roots.roots()] == [str(site)] and roots.config == tmp_path / "cwd" / "ansible.cfg"


def test_neither_a_checkout_nor_a_collection_says_where_it_looked(elsewhere, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_PATH", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    with pytest.raises(OperatorError) as e:
        locate(elsewhere, "recover.yml", path=[str(tmp_path / "site-packages")])
    said = str(e.value)
    assert f"{elsewhere} has no ansible.cfg and playbooks/" in said
    assert f"{tmp_path / 'a'}/ansible_collections (ANSIBLE_COLLECTIONS_PATH)" in said
    assert f"{tmp_path / 'b'}/ansible_collections" in said and f"{tmp_path / 'site-packages'}/ansible_collections (sys.path)" in said
    assert "ansible-galaxy collection install" in said and "Nothing was run" in said
    # found, but without the playbook (the checkout's doc-fragment-only hsx.recovery, an older release)
    fake_collection(tmp_path / "a", playbooks=["recover.yml"])
    with pytest.raises(OperatorError, match=r"has no playbooks/takeover.yml \(hsx.recovery.takeover\)"):
        locate(elsewhere, "takeover.yml", path=[])
    # through a command: exit 2, the reason on stderr, nothing run
    monkeypatch.setattr(playbook, "REPO", elsewhere)
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_PATH", str(tmp_path / "b"))
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_SCAN_SYS_PATH", "0")
    from extraction.cli import main

    for argv in (["recover"], ["takeover", "n1"], ["provision"], ["rollout-patch"], ["fleet-status"]):
        assert main([*argv, "-i", str(tmp_path / "inv"), "--report-dir", str(tmp_path / "r")]) == 2, argv


def test_installed_reports_go_to_the_users_state_directory(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert installed_reports() == tmp_path / "state" / "hsx" / "reports"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert installed_reports() == tmp_path / ".local" / "state" / "hsx" / "reports"
    assert coll_mod.default_reports(tmp_path) == installed_reports() and coll_mod.default_reports(ROOT) == ROOT / "reports"


@pytest.fixture(scope="module")
def hsx_installed(tmp_path_factory) -> Path:
    """hsx's packages as a wheel installs them (no checkout two folders above); their folder."""
    site = tmp_path_factory.mktemp("site")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "extraction", site / "extraction", ignore=ignore)
    shutil.copytree(ROOT / "module_utils" / "hsx", site / "hsx", ignore=ignore)
    return site


def hsx(site: Path, collections: Path, tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    """`hsx ARGV -i INVENTORY` from `site`, run in tmp_path/work with only `collections` configured; the
    inventory: localhost (local), hsx_output_dir a folder that does not exist, no extraction node."""
    (tmp_path / "work").mkdir(exist_ok=True)
    inventory = tmp_path / "work" / "hosts.ini"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable} "
                         f"hsx_output_dir={tmp_path / 'no-output'}\n[extraction_nodes]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(PYTHONPATH=str(site), HOME=str(tmp_path / "home"), XDG_STATE_HOME=str(tmp_path / "state"),
               ANSIBLE_COLLECTIONS_PATH=str(collections), PATH=f"{BIN}:{os.environ['PATH']}")
    code = ("import sys, extraction; assert extraction.__file__.startswith(sys.argv[1]), extraction.__file__; "
            "from extraction.cli import main; sys.exit(main(sys.argv[2:]))")
    return subprocess.run([sys.executable, "-c", code, str(site), *argv, "-i", str(inventory)],
                          cwd=tmp_path / "work", env=env, capture_output=True, text=True, timeout=300)


def test_hsx_recover_check_from_an_install_runs_the_collections_playbook(installed, hsx_installed, tmp_path) -> None:
    run = hsx(hsx_installed, installed, tmp_path, "recover", "--check")
    said = run.stdout + run.stderr
    coll = installed / "ansible_collections" / "hsx" / "recovery"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"hsx recover: playbook hsx.recovery.recover: hsx.recovery {version} installed at {coll}" in run.stderr, said
    assert "No hosts to act on" in said and run.returncode == 1, said  # its target check, on localhost
    reports = tmp_path / "state" / "hsx" / "reports"  # hsx_report_dir: not inside the collection
    command, = (reports / ".runner" / "artifacts").glob("*-recover-*/command")
    recorded = json.loads(command.read_text())
    assert "hsx.recovery.recover" in recorded["command"] and "--check" in recorded["command"], recorded
    assert recorded["cwd"] == str(tmp_path / "work")  # the operator's folder (their ansible.cfg), not the package's


def test_hsx_fleet_status_from_an_install_runs_the_collections_module(installed, hsx_installed, tmp_path) -> None:
    run = hsx(hsx_installed, installed, tmp_path, "fleet-status")
    said = run.stdout + run.stderr
    assert "hsx fleet-status: module hsx.recovery.extraction_status_info: hsx.recovery" in run.stderr, said
    # the module ran on localhost (no job there), it did not fail to load
    assert f"NO JOB: {tmp_path / 'no-output'} does not exist" in run.stdout and run.returncode == 1, said
