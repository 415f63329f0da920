"""The collection's release hygiene: the tarball `make collection` builds carries the changelog kept the
antsibull-changelog way (changelogs/ in this checkout, CHANGELOG.md generated from it), galaxy metadata
with authors and the project's URLs (from pyproject.toml's [project.urls], when it has any), and ONE
version (pyproject.toml's) that the changelog, galaxy.yml, MANIFEST.json and the tarball's name agree on.
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
    assert build.latest_release(changes) == version
    assert changes["releases"][version]["changes"]["release_summary"].strip()
    text = changelog_md.replace("\\", "")  # markdown escapes: "v0\\.1\\.0"
    assert "# hsx.recovery Release Notes" in text and f"## v{version}\n" in text


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


def test_the_source_changelog_releases_the_projects_version_and_leaves_fragments_for_what_comes():
    changes = yaml.safe_load((ROOT / "changelogs" / "changelog.yaml").read_text())
    assert build.latest_release(changes) == PROJECT["version"]
    config = yaml.safe_load((ROOT / "changelogs" / "config.yaml").read_text())
    assert config["notesdir"] == "fragments" and config["output"] == [{"file": "CHANGELOG.md", "format": "md"}]
    assert (ROOT / "changelogs" / "fragments").is_dir()


def test_a_version_the_changelog_has_not_released_stops_the_build_saying_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "project_version", lambda: "9.9.9")
    with pytest.raises(build.BuildError, match=r"changelogs/changelog\.yaml.*9\.9\.9.*--release"):
        build.build(tmp_path)


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
