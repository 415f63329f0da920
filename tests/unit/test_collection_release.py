"""The collection's release hygiene: the tarball `make collection` builds carries the changelog kept the
antsibull-changelog way (changelogs/ in this checkout, CHANGELOG.md generated from it), galaxy metadata
with authors and the project's URLs (from pyproject.toml's [project.urls], when it has any), and ONE
version (pyproject.toml's) that galaxy.yml, MANIFEST.json and the tarball's name agree on, which is either
the changelog's latest release with no fragments waiting or above it: never a released version shipped with
other content.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

import extraction

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("hsx_collection_build", ROOT / "tools" / "collection" / "build.py")
build = sys.modules.get(_spec.name) or importlib.util.module_from_spec(_spec)
if _spec.name not in sys.modules:
    sys.modules[_spec.name] = build
    _spec.loader.exec_module(build)

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def tarball(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("collection")
    return build.build_tarball(build.build(out), out / "dist")


def member(tar: tarfile.TarFile, name: str) -> str:
    f = tar.extractfile(name)
    assert f is not None, name
    return f.read().decode()


def test_the_tarball_holds_the_changelog_the_galaxy_fields_and_one_version(tarball):
    version = PROJECT["version"]
    assert tarball.name == f"hsx-recovery-{version}.tar.gz" and tarball.is_file()
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
        info = json.loads(member(tar, "MANIFEST.json"))["collection_info"]
        changes = yaml.safe_load(member(tar, "changelogs/changelog.yaml"))
        changelog_md = member(tar, "CHANGELOG.md")
    assert {"CHANGELOG.md", "changelogs/changelog.yaml", "changelogs/config.yaml"} <= names
    assert not [n for n in names if n.startswith("changelogs/fragments/") or n.endswith(".plugin-cache.yaml")]
    assert info["version"] == version
    assert info["authors"] == ["hsx maintainers"]
    urls = build.galaxy_urls(PROJECT)
    for field in ("repository", "documentation", "homepage", "issues"):
        assert info[field] == urls.get(field), field  # None in MANIFEST.json: the project has no URL yet
    latest = build.latest_release(changes)
    assert latest == version or Version(version) > Version(latest)
    assert changes["releases"][latest]["changes"]["release_summary"].strip()
    text = changelog_md.replace("\\", "")  # markdown escapes: "v0\\.1\\.0"
    assert "# hsx.recovery Release Notes" in text and f"## v{latest}\n" in text


def test_galaxy_urls_come_from_the_projects_own_urls_only():
    project = {"urls": {"Repository": "https://git.hsx.example/hsx", "Documentation": "https://docs.hsx.example/",
                        "Homepage": "https://hsx.example/", "Issues": "https://git.hsx.example/hsx/issues",
                        "Changelog": "https://hsx.example/changes"}}
    assert build.galaxy_urls(project) == {
        "repository": "https://git.hsx.example/hsx", "documentation": "https://docs.hsx.example/",
        "homepage": "https://hsx.example/", "issues": "https://git.hsx.example/hsx/issues"}
    assert build.galaxy_urls({"urls": {"source": "https://git.hsx.example/hsx"}}) == {
        "repository": "https://git.hsx.example/hsx"}  # PyPI's other spelling of the same key
    assert build.galaxy_urls({}) == {}


def test_the_checkout_never_ships_a_released_version_with_unreleased_fragments():
    changes = yaml.safe_load((ROOT / "changelogs" / "changelog.yaml").read_text())
    latest, version, waiting = build.latest_release(changes), PROJECT["version"], build.fragments(ROOT / "changelogs")
    assert (version == latest and not waiting) or Version(version) > Version(latest), (version, latest, waiting)
    build.check_versions(version, latest, waiting)  # the build's own rule agrees
    assert extraction.__version__ == version  # `hsx --version` says the same
    config = yaml.safe_load((ROOT / "changelogs" / "config.yaml").read_text())
    assert config["notesdir"] == "fragments" and config["output"] == [{"file": "CHANGELOG.md", "format": "md"}]
    assert (ROOT / "changelogs" / "fragments").is_dir()


@pytest.mark.parametrize(("version", "latest", "waiting", "publish", "error"), [
    ("0.2.0", "0.2.0", ["51-canary.yml"], False, r"0\.2\.0 is released .*\(51-canary\.yml.*next release"),
    ("0.1.0", "0.2.0", [], False, r"0\.1\.0 is below .*latest release 0\.2\.0"),
    ("0.3.0", None, [], False, r"no release; release 0\.3\.0"),
    ("0.3.0", "0.2.0", ["x.yml"], True, r"0\.3\.0 is not released.*--release"),
    ("0.3.0", "0.2.0", ["x.yml"], False, None),  # what comes next, unreleased: a development build
    ("0.2.0", "0.2.0", [], True, None),
    ("0.10.0", "0.9.0", [], False, None),  # versions, not strings
])
def test_a_build_never_ships_a_released_version_with_other_content(version, latest, waiting, publish, error):
    if error is None:
        build.check_versions(version, latest, waiting, publish)
    else:
        with pytest.raises(build.BuildError, match=error):
            build.check_versions(version, latest, waiting, publish)


def test_the_build_applies_the_version_rule_to_the_changelog_it_ships(tmp_path, monkeypatch):
    changes = yaml.safe_load((ROOT / "changelogs" / "changelog.yaml").read_text())
    monkeypatch.setattr(build, "project_version", lambda: build.latest_release(changes))
    changelogs = tmp_path / "changelogs"
    shutil.copytree(ROOT / "changelogs", changelogs)
    (changelogs / "fragments" / "99-late.yml").write_text("bugfixes:\n  - shard_verify - a late change.\n")
    monkeypatch.setattr(build, "CHANGELOGS", changelogs)
    with pytest.raises(build.BuildError, match=r"is released .*99-late\.yml"):
        build.build(tmp_path / "out")


def test_latest_release_orders_versions_not_strings():
    assert build.latest_release({"releases": {"0.9.0": {}, "0.10.0": {}, "0.2.0": {}}}) == "0.10.0"
    assert build.latest_release({"ancestor": None, "releases": {}}) is None


@pytest.mark.parametrize("name", build.filter_names())
def test_every_filter_is_documented_as_filter_plugins_are(name):
    # one file holds both filters, so each gets the sidecar ansible-doc and antsibull-docs read
    doc = yaml.safe_load((ROOT / "filter_plugins" / f"{name}.yml").read_text())
    assert doc["DOCUMENTATION"]["name"] == name and doc["DOCUMENTATION"]["options"]["_input"]
    assert f"| {name}" in doc["EXAMPLES"] and doc["RETURN"]["_value"]["description"]


@pytest.mark.parametrize("text", ["releases: [unclosed\n", "- a list\n", "releases:\n  not-a-version: {}\n"])
def test_a_changelog_yaml_that_cannot_be_read_stops_the_build_naming_it(tmp_path, monkeypatch, text):
    changelogs = tmp_path / "changelogs"
    shutil.copytree(ROOT / "changelogs", changelogs)
    (changelogs / "changelog.yaml").write_text(text)
    monkeypatch.setattr(build, "CHANGELOGS", changelogs)
    with pytest.raises(build.BuildError, match=r"^changelogs/changelog\.yaml: .*antsibull-changelog"):
        build.build(tmp_path / "out")
