"""What Galaxy needs of the collection, checked fast (the import itself, ~40 CPU-s, runs in make sanity:
tools/collection/galaxy_import.py): a README in every role, generated from its argument specs; galaxy.yml's
URLs from pyproject.toml's [project.urls] only, a tarball for publishing refused without them, and the
import check's stand-ins a reserved name no one can mistake for the project's.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "tools" / "collection"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules.get(name) or importlib.util.module_from_spec(spec)
    if name not in sys.modules:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


build = _load("hsx_collection_build", HERE / "build.py")
galaxy_import = _load("hsx_galaxy_import", HERE / "galaxy_import.py")
role_readme = build.role_readme
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def placeholder_tarball(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("collection")
    return build.build_tarball(build.build(out, placeholder_urls=True), out / "dist")


def test_every_role_ships_a_readme_generated_from_its_argument_specs(placeholder_tarball):
    with tarfile.open(placeholder_tarball) as tar:
        readmes = {n.split("/")[1]: tar.extractfile(n).read().decode() for n in tar.getnames()
                   if re.fullmatch(r"roles/[^/]+/README\.md", n)}
    assert sorted(readmes) == ROLES
    for role, text in readmes.items():
        specs = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
        assert text.startswith(f"# hsx.recovery.{role}\n") and role_readme.MARKER in text
        for entry_point, spec in specs.items():
            assert f"## Entry point `{entry_point}`" in text, (role, entry_point)
            for option in spec.get("options") or {}:
                assert f"| `{option}` |" in text, (role, entry_point, option)
    kept = list((ROOT / "roles").glob("*/README.md"))
    assert not kept, f"{kept}: a role's README is generated from its argument_specs.yml; edit that instead"


def test_markup_becomes_markdown_and_suboptions_are_rows(tmp_path):
    role = tmp_path / "demo"
    (role / "meta").mkdir(parents=True)
    (role / "meta" / "argument_specs.yml").write_text(yaml.safe_dump({"argument_specs": {
        "main": {"short_description": "Demo C(code).", "description": ["See O(demo_a) and I(this)."],
                 "options": {"demo_a": {"type": "dict", "required": True, "description": "A | B.",
                                        "suboptions": {"x": {"type": "int", "default": 3, "choices": [3, 4]}}}}},
        "other": {"short_description": "Other.", "version_added": "0.2.0"}}}))
    text = role_readme.render(role, "hsx.recovery")
    assert "Demo <code>code</code>" in text and "<em>this</em>" in text
    assert "| `demo_a` | dict | yes |  | A \\| B\\. |" in text
    assert "| `demo_a.x` | int |  | `3` |" in text and "Choices: `3`, `4`" in text
    assert "tasks_from: other" in text and "Added in version 0.2.0." in text and "No options." in text


@pytest.mark.parametrize(("specs", "error"), [
    (None, r"roles/demo/meta/argument_specs\.yml: missing"),
    ("argument_specs: [a]\n", r"roles/demo/meta/argument_specs\.yml: needs `argument_specs:`"),
    ("argument_specs:\n  main: {description: x}\n", r"entry point main needs .*short_description"),
    ("argument_specs:\n  main:\n    short_description: x\n    options: {a: 1}\n", r"option a is not a mapping"),
])
def test_a_role_whose_specs_cannot_make_a_readme_stops_the_build_naming_the_file(tmp_path, specs, error):
    (tmp_path / "demo" / "meta").mkdir(parents=True)
    if specs is not None:
        (tmp_path / "demo" / "meta" / "argument_specs.yml").write_text(specs)
    with pytest.raises(role_readme.RoleReadmeError, match=error):
        role_readme.write_readmes(tmp_path, "hsx.recovery")


def test_the_import_checks_urls_are_its_own_reserved_name_never_the_projects(placeholder_tarball):
    with tarfile.open(placeholder_tarball) as tar:
        info = json.loads(tar.extractfile("MANIFEST.json").read())["collection_info"]
    real = build.galaxy_urls(PROJECT)
    for field in build.PUBLISH_URLS:
        url = real.get(field) or f"{build.PLACEHOLDER_URL}/{field}"
        assert info[field] == url
    assert build.RESERVED_HOST.search("galaxy-import-check.invalid")


def test_a_tarball_for_publishing_is_refused_without_the_projects_urls(tmp_path, monkeypatch):
    earlier = build.build(tmp_path)  # a refused publish leaves an earlier build alone
    with pytest.raises(build.BuildError, match=r"(?s)lacks Repository, Documentation, Issues.*\[project\.urls\]"
                                               r"\nRepository = .*make release"):
        build.publish_urls({})
    with pytest.raises(build.BuildError, match=r"lacks Issues; names a reserved host: repository "):
        build.publish_urls({"urls": {"Repository": f"{build.PLACEHOLDER_URL}/x", "Docs": "https://docs.hsx.test/"}})
    if not build.galaxy_urls(PROJECT):  # as now: no public URL yet
        assert build.main(["--out", str(tmp_path), "--publish"]) == 2
        assert (earlier / "galaxy.yml").is_file()
    with pytest.raises(SystemExit):
        build.main(["--out", str(tmp_path), "--publish", "--placeholder-urls"])
    # the rule, with a host this test alone treats as public
    monkeypatch.setattr(build, "RESERVED_HOST", re.compile(r"(^|\.)invalid$"))
    urls = {"Repository": "https://git.hsx.example/hsx", "Documentation": "https://git.hsx.example/hsx#readme",
            "Issues": "https://git.hsx.example/hsx/issues"}
    assert build.publish_urls({"urls": urls}) == {k.lower(): v for k, v in urls.items()}


def test_galaxys_lint_findings_fail_the_import_check_and_its_other_warnings_do_not():
    recorder = galaxy_import._Recorder()
    log = logging.getLogger("test_collection_publish")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(recorder)
    try:
        log.info("Loading role hsx")
        log.info(f"{galaxy_import.LINT_START} 26.10.1...")
        log.warning("roles/x/tasks/main.yml:3: name[missing]: All tasks should be named.")
        log.info(galaxy_import.LINT_END)
        log.warning("Ignore files skip ansible-test sanity tests, found ignore-2.19.txt with 1 statement(s)")
        log.error("Timeout on call to ansible-lint")
    finally:
        log.removeHandler(recorder)
    assert recorder.lint_seen and recorder.lint_findings == ["roles/x/tasks/main.yml:3: name[missing]: All tasks "
                                                             "should be named."]
    assert len(recorder.warnings) == 1 and recorder.errors == ["Timeout on call to ansible-lint"]
    assert galaxy_import.main(["not-a-tarball"]) == 2
