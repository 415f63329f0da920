"""tools/collection/build.py: the collection hsx.recovery generated from the project's own files.

What the generation must guarantee, since the generated copy is what users install: every module's
import of the core names the collection's module_utils (and each such module exists there), our
filters are called by FQCN in every generated role and playbook, every module, role and playbook
of the project is in it (globs, not a list), and one license is stated everywhere."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("hsx_collection_build", ROOT / "tools" / "collection" / "build.py")
build = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = build
_spec.loader.exec_module(build)

LICENSE_ID = "GPL-3.0-or-later"
MODULES = sorted(p.name for p in (ROOT / "library").glob("*.py"))


@pytest.fixture(scope="module")
def coll(tmp_path_factory) -> Path:
    return build.build(tmp_path_factory.mktemp("collection"))


def imported_modules(source: str) -> list[str]:
    """Every absolute module name an import statement of `source` names (any depth)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


@pytest.mark.parametrize("name", MODULES)
def test_every_core_import_of_a_module_names_the_collections_module_utils(coll, name):
    project = imported_modules((ROOT / "library" / name).read_text())
    generated = imported_modules((coll / "plugins" / "modules" / name).read_text())
    assert not [m for m in generated if m.startswith(build.PROJECT_MU)]
    expected = [m.replace(build.PROJECT_MU, build.COLLECTION_MU, 1) if build._is_project_mu(m) else m for m in project]
    assert generated == expected  # the same imports, in the same order; only the core's are renamed
    for module in generated:
        if module.startswith(build.COLLECTION_MU):
            rel = Path(*module.split(".")[4:])  # after ansible_collections.hsx.recovery.plugins
            assert (coll / "plugins" / f"{rel}.py").is_file() or (coll / "plugins" / rel / "__init__.py").is_file(), module


def test_the_core_maps_verbatim_and_imports_itself_only_relatively(coll):
    sources = sorted((ROOT / "module_utils" / "hsx").rglob("*.py"))
    for path in sources:
        copy = coll / "plugins" / "module_utils" / path.relative_to(ROOT / "module_utils")
        assert copy.read_text() == path.read_text(), path
        assert not [m for m in imported_modules(path.read_text()) if m.startswith("ansible")], path


def test_the_rewrite_keeps_docstrings_and_handles_parenthesised_imports():
    source = ('"""Uses ansible.module_utils.hsx.index (this text stays)."""\n'
              "from ansible.module_utils.hsx.patching import (\n    Patch,\n    plan,\n)\n"
              "from ansible.module_utils.basic import AnsibleModule\n")
    out = build.rewrite_imports(source, "x.py")
    assert out.splitlines()[0] == source.splitlines()[0]
    assert f"from {build.COLLECTION_MU}.patching import (\n    Patch,\n    plan,\n)\n" in out
    assert "from ansible.module_utils.basic import AnsibleModule" in out


@pytest.mark.parametrize("source", [
    "import ansible.module_utils.hsx.index\n",  # binds `ansible`: a rename would break its uses
    "from \\\n  ansible.module_utils.hsx.index import read_index\n",  # the name is not on the import's first line
])
def test_an_import_the_rewrite_cannot_cover_stops_the_build_naming_file_and_line(source):
    with pytest.raises(build.BuildError, match=r"^lib/x\.py:1: "):
        build.rewrite_imports(source, "lib/x.py")


def test_filters_are_called_by_fqcn_in_every_generated_role_and_playbook(coll):
    names = build.filter_names()
    assert set(names) >= {"hsx_systemd", "hsx_redact"}
    bare = re.compile(r"\|\s*(" + "|".join(names) + r")\b")
    fqcn = re.compile(r"\|\s*" + re.escape(build.FQCN) + r"\.(" + "|".join(names) + r")\b")
    used = 0
    for tree in ("roles", "playbooks"):
        for path in (ROOT / tree).rglob("*"):
            if path.is_file() and path.suffix in build.TEXT_SUFFIXES:
                copy = (coll / path.relative_to(ROOT)).read_text()
                assert not bare.search(copy), path
                assert len(fqcn.findall(copy)) == len(bare.findall(path.read_text())), path
                used += len(fqcn.findall(copy))
    assert used > 0  # the project's roles do call them: the check above looked at real uses


def test_every_module_role_and_playbook_of_the_project_is_in_the_collection(coll):
    assert sorted(p.name for p in (coll / "plugins" / "modules").glob("*.py")) == MODULES
    roles = sorted(p.name for p in (ROOT / "roles").iterdir() if p.is_dir())
    assert roles and sorted(p.name for p in (coll / "roles").iterdir()) == roles
    # ... and self-healing's playbooks, where FQCNs find them (hsx.recovery.selfheal_remedy, _verify).
    eda = ROOT / "extensions" / "eda" / "playbooks"
    assert sorted(p.name for p in (coll / "playbooks").glob("*.yml")) == sorted(
        p.name for p in [*(ROOT / "playbooks").glob("*.yml"), *eda.glob("*.yml")])
    for path in eda.glob("*.yml"):
        assert (coll / "playbooks" / path.name).read_text() == build.rewrite_filters(path.read_text(), build.filter_names())
    assert not (coll / "extensions" / "eda" / "playbooks").exists()  # one copy
    sources = [p.stem for p in (ROOT / "extensions" / "eda" / "plugins" / "event_source").glob("*.py")]
    assert sources and (coll / "extensions" / "eda" / "plugins" / "event_source" / f"{sources[0]}.py").is_file()
    for path in (coll / "extensions" / "eda" / "rulebooks").glob("*.yml"):  # installed, a source is found by FQCN
        book = yaml.safe_load(path.read_text())
        names = {name for src in book[0]["sources"] for name in src if name not in ("name", "filters")}
        assert names == {f"{build.FQCN}.{s}" for s in sources}, (path.name, names)
    links = [p for p in coll.rglob("*") if p.is_symlink()]
    assert links == []  # a role's file linking into extraction/ is copied as the file
    assert (coll / "plugins" / "filter" / "hsx_filters.py").is_file()
    assert (coll / "plugins" / "module_utils" / "hsx" / "redact.py").is_file()  # the filter loads it by path


def test_galaxy_metadata_version_and_license_come_from_the_project(coll):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    galaxy = yaml.safe_load((coll / "galaxy.yml").read_text())
    assert (galaxy["namespace"], galaxy["name"]) == ("hsx", "recovery")
    assert galaxy["version"] == project["version"]
    assert galaxy["license"] == [project["license"]] == [LICENSE_ID]
    assert yaml.safe_load((coll / "meta" / "runtime.yml").read_text())["requires_ansible"].startswith(">=2.19")
    assert yaml.safe_load((coll / "tests" / "config.yml").read_text()) == {"modules": {"python_requires": ">=3.10"}}


def test_one_license_everywhere():
    assert (ROOT / "LICENSE").read_text().splitlines()[:2] == [
        " " * 20 + "GNU GENERAL PUBLIC LICENSE", " " * 23 + "Version 3, 29 June 2007"]
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == LICENSE_ID
    for name in MODULES:
        head = (ROOT / "library" / name).read_text().splitlines()[:6]
        assert f"# SPDX-License-Identifier: {LICENSE_ID}" in head, name
    for meta in sorted((ROOT / "roles").glob("*/meta/main.yml")):
        assert yaml.safe_load(meta.read_text())["galaxy_info"]["license"] == LICENSE_ID, meta


def test_modules_state_the_python_minimum_the_collection_declares():
    for name in MODULES:
        text = (ROOT / "library" / name).read_text()
        doc = yaml.safe_load(ast.literal_eval(re.search(r'DOCUMENTATION = (r""".*?""")', text, re.S).group(1)))
        assert "python >= 3.10 on the managed host" in doc.get("requirements", []), name


def test_the_only_sanity_ignores_are_the_shebangs_of_host_side_python3_scripts(coll, tmp_path):
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "roles").glob("*/files/**/*")
                     if p.is_file() and p.read_bytes().split(b"\n", 1)[0] in build.HOST_PYTHON3_SHEBANGS)
    ignore = coll / "tests" / "sanity" / f"ignore-{build.ansible_core_series()}.txt"
    lines = ignore.read_text().splitlines() if ignore.exists() else []
    assert [line.split(" ")[:2] for line in lines] == [[s, "shebang"] for s in scripts]
    assert all(" # " in line and "managed host" in line for line in lines)  # each says why
    assert not list((coll / "tests" / "sanity").glob("ignore-*.txt"))[1:]  # one file, for this release
    # a new role script is picked up by the glob, and only a python3 one
    fake = tmp_path / "roles" / "r" / "files"
    fake.mkdir(parents=True)
    (fake / "tool").write_text("#!/usr/bin/env python3\n")
    (fake / "other").write_text("#!/bin/sh\n")
    assert [line.split(" ")[:2] for line in build.sanity_ignores(tmp_path)] == [["roles/r/files/tool", "shebang"]]


def module_doc(path: Path) -> dict:
    """A module file's DOCUMENTATION, parsed."""
    return yaml.safe_load(ast.literal_eval(re.search(r'DOCUMENTATION = (r""".*?""")', path.read_text(), re.S).group(1)))


def test_modules_share_the_attributes_text_through_the_doc_fragment(coll):
    """Issue #42 item 2: the attributes' descriptions are written once (doc_fragments/attributes.py)."""
    fragment_path = coll / "plugins" / "doc_fragments" / "attributes.py"
    assert fragment_path.read_text() == (ROOT / "doc_fragments" / "attributes.py").read_text()
    spec = importlib.util.spec_from_file_location("hsx_attributes_fragment", fragment_path)
    fragment_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fragment_module)
    shared = {name: attr for var in ("DOCUMENTATION", "FACTS")  # FACTS: hsx.recovery.attributes.facts
              for name, attr in yaml.safe_load(getattr(fragment_module.ModuleDocFragment, var))["attributes"].items()}
    texts = {a["description"] for a in shared.values()}
    for name in MODULES:
        doc = module_doc(ROOT / "library" / name)
        assert f"{build.FQCN}.attributes" in doc.get("extends_documentation_fragment", []), name
        own = doc.get("attributes", {})
        assert {"check_mode", "diff_mode"} <= set(own), name  # each module says its support
        for attr, value in own.items():
            assert value.get("description") not in texts, f"{name}: {attr} copies the fragment's text"
            assert attr in shared, f"{name}: {attr} has no shared description"


def test_runtime_groups_the_output_modules_and_routes_the_old_name(coll):
    """Issue #42 item 2: `group/hsx.recovery.extraction_output` holds exactly the modules whose `path`
    is the extraction's output directory, and extraction_status is routed to extraction_status_info."""
    runtime = yaml.safe_load((coll / "meta" / "runtime.yml").read_text())
    group = runtime["action_groups"]["extraction_output"]
    modules = {p.stem for p in (coll / "plugins" / "modules").glob("*.py")}
    assert set(group) == {"shard_verify", "extraction_status_info"} and set(group) <= modules
    for name in group:
        option = module_doc(ROOT / "library" / f"{name}.py")["options"]["path"]
        text = " ".join(option["description"]) if isinstance(option["description"], list) else option["description"]
        assert option["type"] == "path" and "output" in text, name
    route = runtime["plugin_routing"]["modules"]["extraction_status"]
    assert "extraction_status" not in modules
    assert route["redirect"] == f"{build.FQCN}.extraction_status_info"
    assert route["deprecation"]["removal_version"] and "extraction_status_info" in route["deprecation"]["warning_text"]


def test_the_control_node_requirement_is_declared_where_ansible_builder_reads_it(coll):
    """Issue #42 item 4, #50 item 3: meta/execution-environment.yml names requirements.txt and bindep.txt;
    requirements.txt names no package (hsx is on no index: a name there would be resolved from one by
    every execution environment built from the collection) and says where hsx comes from instead; the
    collection's bindep.txt is the checkout's."""
    ee = yaml.safe_load((coll / "meta" / "execution-environment.yml").read_text())
    assert ee["version"] == 1 and ee["dependencies"] == {"python": "requirements.txt", "system": "bindep.txt"}
    text = (coll / "requirements.txt").read_text()
    assert [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")] == []
    assert f"hsx-control {build.project_version()}" in text and "execution-environment/build.py" in text
    assert (coll / "bindep.txt").read_text() == (ROOT / "bindep.txt").read_text()
