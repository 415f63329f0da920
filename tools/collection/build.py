#!/usr/bin/env python3
"""Generate the Ansible collection hsx.recovery from the project's own files (`make collection`).

The collection is GENERATED into an ignored folder (default `.cache/collection`), never kept as a
second copy in git. One source, two layouts:

    project (ansible.cfg paths)          collection (ansible_collections/hsx/recovery/)
    library/*.py                    ->   plugins/modules/*.py     imports rewritten (below)
    module_utils/hsx/**             ->   plugins/module_utils/hsx/**   verbatim
    filter_plugins/*.py             ->   plugins/filter/*.py      verbatim
    filter_plugins/*.yml            ->   plugins/filter/*.yml     the filters' docs; filter names -> FQCN
    doc_fragments/*.py              ->   plugins/doc_fragments/*.py  verbatim (modules name them by FQCN)
    roles/**                        ->   roles/**                 links followed; filter names -> FQCN
    playbooks/**                    ->   playbooks/**             filter names -> FQCN
    extensions/eda/**               ->   extensions/eda/**        the self-healing rulebooks and webhook source;
                                                                  the rulebooks name our sources by FQCN
    extensions/eda/playbooks/*.yml  ->   playbooks/*.yml          their remedy wrapper and verification, by FQCN
    LICENSE, tools/collection/{galaxy.yml.in,README.md,runtime.yml,config.yml} -> the collection's own
    tools/collection/{execution-environment.yml,requirements.txt.in}, bindep.txt -> meta/, requirements.txt,
        bindep.txt: what the control node needs, where ansible-builder reads it (no Python name an index
        would resolve: hsx comes from the project's own wheel, execution-environment/)
    changelogs/{config.yaml,changelog.yaml,fragments/} ->   changelogs/**  and CHANGELOG.md generated
    roles/*/meta/argument_specs.yml ->   roles/*/README.md        generated (role_readme.py): Galaxy needs one
    (generated) tests/sanity/ignore-2.19.txt: the host-side python3 scripts' shebangs (sanity_ignores)

Why the two rewrites, and nothing else:
- Modules import the core as `ansible.module_utils.hsx.X` (where ansible.cfg's `module_utils`
  puts it). A collection's module_utils are `ansible_collections.hsx.recovery.plugins.module_utils.X`,
  and Ansible ships to the host exactly what a module imports, so the generated copies say that
  (`rewrite_imports`; tests/unit/test_collection_build.py proves every import is covered). The
  core itself imports its siblings relatively only (tests/unit/test_portable_core.py), so it maps
  as it is.
- Roles call our modules by short name. A role inside a collection searches its own collection
  first for modules and roles (ansible-core: a collection-hosted role puts its collection at the
  head of its search list), so those stay. Jinja filters get no such search: a collection role
  must name `hsx.recovery.hsx_systemd`, while the project layout only knows `hsx_systemd`
  (filter_plugins/). The generated roles and playbooks therefore name our filters by FQCN
  (`rewrite_filters`; the filter names come from the FilterModule, one source of truth).

The modules' unit tests stay in tests/unit rather than `ansible-test units` in the collection: they
load the modules as the project layout ships them (tests/unit/ansible_modules.py) and build real
shards with torch and the extraction package, so running them there would need a rewritten second
copy of each test and torch in ansible-test's venv. The generated copies are covered by sanity's
compile and import tests (tools/collection/sanity.sh) and run installed, by FQCN, against a lab host
in tests/integration/test_collection.py.

The changelog is kept the antsibull-changelog way in this checkout's changelogs/ (a fragment per
user-visible change in changelogs/fragments/); antsibull-changelog needs a collection (galaxy.yml), so
it runs in the generated one: `generate` writes its CHANGELOG.md at every build, and `--release`
turns the fragments into pyproject.toml's version's release there and writes changelogs/changelog.yaml
back here (the fragments it used are removed here, as antsibull-changelog does). The version lives in
pyproject.toml only. A build never ships a released version with other content: pyproject.toml's
version is either the changelog's latest release with no fragments waiting, or above it (what comes
next: bump the version with the first fragment after a release); anything else stops the build (exit 2,
`check_versions` says what to do).

galaxy.yml's repository/documentation/homepage/issues come from pyproject.toml's [project.urls] only.
The project has no public URL yet: a plain build leaves them out; `--publish` (`make release`, the
tarball for publishing) refuses without Repository, Documentation and Issues there (or with a reserved
name such as *.invalid) and says how to add them; `--placeholder-urls` (Galaxy's import check in
tools/collection/sanity.sh only) fills what is missing with PLACEHOLDER_URL, a reserved name that can
never be mistaken for the project's.

Exit status: 0 built, 2 a source does not have the shape the rewrite relies on, or the changelog does
not release pyproject.toml's version (the message says which file and what to do), 1 antsibull-changelog
failed (its output is shown).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import role_readme  # noqa: E402  (tools/collection/role_readme.py)

NAMESPACE, NAME = "hsx", "recovery"
FQCN = f"{NAMESPACE}.{NAME}"
PROJECT_MU = "ansible.module_utils.hsx"
COLLECTION_MU = f"ansible_collections.{NAMESPACE}.{NAME}.plugins.module_utils.hsx"
DEFAULT_OUT = ROOT / ".cache" / "collection"
TEXT_SUFFIXES = {".yml", ".yaml", ".j2", ".md"}
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
HOST_PYTHON3_SHEBANGS = (b"#!/usr/bin/python3", b"#!/usr/bin/env python3")
CHANGELOGS = ROOT / "changelogs"
# galaxy.yml's URL fields from pyproject.toml's [project.urls] (PEP 621 / PyPI's well-known labels,
# compared as PyPI does: case, spaces, "-" and "_" ignored).
GALAXY_URL_LABELS = {"repository": ("repository", "source", "sourcecode"), "documentation": ("documentation", "docs"),
                     "homepage": ("homepage",), "issues": ("issues", "bugtracker", "issuetracker", "bugs")}
PUBLISH_URLS = {"repository": "Repository", "documentation": "Documentation", "issues": "Issues"}
# A reserved name (RFC 6761 .invalid): Galaxy's import check needs a repository URL, the project has none.
PLACEHOLDER_URL = "https://galaxy-import-check.invalid/hsx.recovery"
RESERVED_HOST = re.compile(r"(^|\.)(invalid|example|test|localhost|example\.(com|net|org))$")


class BuildError(Exception):
    """A source file does not have the shape the generation relies on."""


class ChangelogError(Exception):
    """antsibull-changelog failed (the message holds its output)."""


def collection_dir(out: Path) -> Path:
    """Where the collection lies under `out` (ansible-test needs ansible_collections/NS/NAME)."""
    return out / "ansible_collections" / NAMESPACE / NAME


def ansible_core_series() -> str:
    """The running ansible-core's X.Y (constraints.txt pins it): ansible-test reads ignore-X.Y.txt."""
    from ansible.release import __version__

    return ".".join(__version__.split(".")[:2])


def project_version() -> str:
    """The collection's version is the package's (pyproject.toml [project] version)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def rewrite_imports(source: str, where: str) -> str:
    """`source` with every `ansible.module_utils.hsx` import naming the collection's module_utils.

    Only import statements are rewritten (found by the AST, so docstrings and comments stay as
    they are); the text after the rewrite must hold no import of the project path. BuildError
    names the file and line of an import this cannot rewrite (e.g. `import ansible.module_utils.hsx`,
    which would bind a different name)."""
    lines = source.splitlines(keepends=True)
    for node in ast.walk(ast.parse(source, filename=where)):
        if isinstance(node, ast.Import) and any(_is_project_mu(a.name) for a in node.names):
            raise BuildError(f"{where}:{node.lineno}: use `from {PROJECT_MU}.X import ...`, not `import`")
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_project_mu(node.module or ""):
            i = node.lineno - 1
            new = re.sub(rf"\bfrom\s+{re.escape(PROJECT_MU)}\b", f"from {COLLECTION_MU}", lines[i], count=1)
            if new == lines[i]:
                raise BuildError(f"{where}:{node.lineno}: `from {PROJECT_MU}` must start the import's first line")
            lines[i] = new
    return "".join(lines)


def _is_project_mu(module: str) -> bool:
    return module == PROJECT_MU or module.startswith(PROJECT_MU + ".")


def filter_names() -> list[str]:
    """Our filters' names, as filter_plugins/*.py declare them (the FilterModule's dict keys)."""
    names: list[str] = []
    for path in sorted((ROOT / "filter_plugins").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef) and node.name == "filters":
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Dict):
                        names += [k.value for k in ret.value.keys if isinstance(k, ast.Constant)]
    if not names:
        raise BuildError("filter_plugins/: no FilterModule.filters() returning a dict literal")
    return names


def rewrite_filters(text: str, names: list[str]) -> str:
    """`text` (YAML/Jinja) with `| name` of each of our filters written `| hsx.recovery.name`."""
    pattern = re.compile(r"(\|\s*)(" + "|".join(map(re.escape, names)) + r")\b")
    return pattern.sub(lambda m: f"{m.group(1)}{FQCN}.{m.group(2)}", text)


def rewrite_sources(text: str, names: list[str]) -> str:
    """A rulebook's `NAME:` keys of our event source plugins written `hsx.recovery.NAME:`: installed,
    ansible-rulebook finds a collection's source by FQCN only (the checkout's rulebook takes it from
    `-S extensions/eda/plugins/event_source` by its short name)."""
    pattern = re.compile(r"^(\s*(?:-\s+)?)(" + "|".join(map(re.escape, names)) + r"):", re.M)
    return pattern.sub(lambda m: f"{m.group(1)}{FQCN}.{m.group(2)}:", text)


def _copy_tree(src: Path, dst: Path, names: list[str]) -> None:
    """src copied to dst, links followed (a role's file may link into extraction/), our filter
    names made FQCN in text files."""
    shutil.copytree(src, dst, symlinks=False, ignore=SKIP)
    for path in dst.rglob("*"):
        if path.is_file() and path.suffix in TEXT_SUFFIXES:
            text = path.read_text()
            new = rewrite_filters(text, names)
            if new != text:
                path.write_text(new)


def _template(name: str, version: str) -> str:
    return (HERE / name).read_text().replace("@VERSION@", version)


def galaxy_urls(project: dict) -> dict[str, str]:
    """galaxy.yml's repository/documentation/homepage/issues from `project` (pyproject.toml's
    [project] table): its [project.urls] entries with the matching labels; fields it lacks are left
    out (the project has no public URL yet: none is invented)."""
    urls = {re.sub(r"[-_.\s]", "", k.lower()): v for k, v in project.get("urls", {}).items()}
    found = {field: next((urls[label] for label in labels if label in urls), None)
             for field, labels in GALAXY_URL_LABELS.items()}
    return {field: url for field, url in found.items() if url}


def latest_release(changes: dict) -> str | None:
    """The highest version (by version order, not text) that a changelog.yaml's releases hold."""
    releases = changes.get("releases") or {}
    return str(max(releases, key=Version)) if releases else None


def publish_urls(project: dict) -> dict[str, str]:
    """galaxy_urls(project) for a tarball to publish; BuildError naming the [project.urls] entries that
    are missing or name a reserved host, and how to add them."""
    from urllib.parse import urlsplit

    urls = galaxy_urls(project)
    missing = [label for field, label in PUBLISH_URLS.items() if field not in urls]
    reserved = [f"{field} {url}" for field, url in urls.items() if RESERVED_HOST.search(urlsplit(url).hostname or "")]
    if missing or reserved:
        example = "".join(f'{label} = "https://<your host>/.../hsx{path}"\n' for label, path in
                          (("Repository", ""), ("Documentation", "#readme"), ("Issues", "/issues")))
        raise BuildError(
            "a tarball for publishing needs the project's public URLs (Galaxy requires galaxy.yml's repository); "
            f"pyproject.toml's [project.urls] {'lacks ' + ', '.join(missing) if missing else ''}"
            f"{'; ' if missing and reserved else ''}{'names a reserved host: ' + ', '.join(reserved) if reserved else ''}. "
            f"Add them there (galaxy.yml takes them from nowhere else), e.g.\n[project.urls]\n{example}"
            "and run `make release` again")
    return urls


def _galaxy_yml(version: str, urls: dict[str, str]) -> str:
    extra = "".join(f"{field}: {json.dumps(url)}\n" for field, url in urls.items())
    return _template("galaxy.yml.in", version) + extra


def _antsibull_changelog(coll: Path, *args: str) -> None:
    """antsibull-changelog ARGS run in the generated collection; ChangelogError with its output if it fails."""
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(coll.parents[2]),  # its plugin scan finds hsx.recovery
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))  # its ansible-doc
    done = subprocess.run([sys.executable, "-m", "antsibull_changelog", *args], cwd=coll, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise ChangelogError(f"antsibull-changelog {' '.join(args)} failed in {coll} (fix what it names in "
                             f"changelogs/, this checkout's, and run again):\n{done.stdout}{done.stderr}")


def fragments(changelogs: Path) -> list[str]:
    """The unreleased fragments in `changelogs`/fragments (what antsibull-changelog reads: *.yml, *.yaml)."""
    return sorted(p.name for p in (changelogs / "fragments").glob("*") if p.suffix in (".yml", ".yaml")
                  and not p.name.startswith("."))


def check_versions(version: str, latest: str | None, waiting: list[str], publish: bool = False) -> None:
    """BuildError unless `version` (pyproject.toml's) may ship given the changelog's `latest` release and the
    fragments `waiting` in changelogs/fragments: the latest release with none waiting, or (not for `publish`)
    a version above it. Never a released version with other content, never one below the latest."""
    where = "changelogs/changelog.yaml"
    if latest is None:
        raise BuildError(f"{where}: no release; release {version} (tools/collection/build.py --release)")
    if Version(version) < Version(latest):
        raise BuildError(f"pyproject.toml's version {version} is below {where}'s latest release {latest}: fix the version")
    if version == latest and waiting:
        raise BuildError(
            f"{version} is released ({where}), but changelogs/fragments/ holds {len(waiting)} change(s) it does not "
            f"have ({', '.join(waiting)}): a build would ship them as {version}. Set pyproject.toml's version "
            f"(and extraction/__init__.py's) to the next release, above it; or, while {version} is not published, "
            "fold them into it (tools/collection/build.py --release again)")
    if publish and version != latest:
        raise BuildError(f"{version} is not released ({where}'s latest is {latest}): release it first "
                         "(tools/collection/build.py --release), then `make release`")


def _check_changelog(coll: Path, version: str, publish: bool = False) -> None:
    """check_versions for `version` (pyproject.toml's) against the collection's changelogs/; BuildError
    also when changelog.yaml is not a changelog (not YAML, not a mapping, a release that is no version)."""
    try:
        changes = yaml.safe_load((coll / "changelogs" / "changelog.yaml").read_text())
        if not isinstance(changes, dict) or not isinstance(changes.get("releases") or {}, dict):
            raise ValueError("not a mapping with a mapping `releases`")
        latest = latest_release(changes)
    except (OSError, yaml.YAMLError, ValueError, InvalidVersion) as e:
        raise BuildError(f"changelogs/changelog.yaml: not a changelog antsibull-changelog keeps ({e}); "
                         "restore it from git (`git checkout changelogs/changelog.yaml`)") from None
    check_versions(version, latest, fragments(coll / "changelogs"), publish)


def release(out: Path) -> Path:
    """Release pyproject.toml's version: build the collection under `out`, run `antsibull-changelog
    release` there (the fragments become the release; new modules are listed), write its
    changelogs/changelog.yaml back to this checkout and remove the fragments it used; then the
    collection's CHANGELOG.md. Returns the collection's directory."""
    coll = build(out, check_changelog=False)
    _antsibull_changelog(coll, "release", "--version", project_version())
    shutil.copy2(coll / "changelogs" / "changelog.yaml", CHANGELOGS / "changelog.yaml")
    for fragment in (CHANGELOGS / "fragments").iterdir():
        if not fragment.name.startswith(".") and not (coll / "changelogs" / "fragments" / fragment.name).exists():
            fragment.unlink()
    _antsibull_changelog(coll, "generate")
    return coll


def build(out: Path, check_changelog: bool = True, publish: bool = False, placeholder_urls: bool = False) -> Path:
    """Generate the collection under `out` (replacing an earlier one); returns its directory.
    BuildError when pyproject.toml's version may not ship with changelogs/ as it is (check_versions; not
    checked when `check_changelog` is false: what `release` uses to make it so), and for `publish` also
    without the project's public URLs (publish_urls). `placeholder_urls`: galaxy.yml's missing URLs are
    PLACEHOLDER_URL's (Galaxy's import check only)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    urls = publish_urls(project) if publish else galaxy_urls(project)  # before an earlier build is removed
    if placeholder_urls and not publish:
        urls = {field: f"{PLACEHOLDER_URL}/{field}" for field in PUBLISH_URLS} | urls
    coll = collection_dir(out)
    if coll.exists():
        shutil.rmtree(coll)
    version, names = project_version(), filter_names()
    modules = coll / "plugins" / "modules"
    modules.mkdir(parents=True)
    for path in sorted((ROOT / "library").glob("*.py")):
        rel = str(path.relative_to(ROOT))
        (modules / path.name).write_text(rewrite_imports(path.read_text(), rel))
    shutil.copytree(ROOT / "module_utils" / "hsx", coll / "plugins" / "module_utils" / "hsx", ignore=SKIP)
    _copy_tree(ROOT / "filter_plugins", coll / "plugins" / "filter", names)  # the docs' examples name FQCNs
    shutil.copytree(ROOT / "doc_fragments", coll / "plugins" / "doc_fragments", ignore=SKIP)
    _copy_tree(ROOT / "roles", coll / "roles", names)
    try:
        role_readme.write_readmes(coll / "roles", FQCN)
    except role_readme.RoleReadmeError as e:
        raise BuildError(str(e)) from None
    _copy_tree(ROOT / "playbooks", coll / "playbooks", names)
    _copy_tree(ROOT / "extensions", coll / "extensions", names)  # the self-healing rulebooks and event source
    sources = sorted(path.stem for path in (ROOT / "extensions" / "eda" / "plugins" / "event_source").glob("*.py"))
    for path in sorted((coll / "extensions" / "eda" / "rulebooks").glob("*.yml")):
        path.write_text(rewrite_sources(path.read_text(), sources))
    # Its playbooks where FQCNs find them (ansible-rulebook's run_playbook, ansible-playbook):
    # hsx.recovery.selfheal_remedy and hsx.recovery.selfheal_verify.
    for path in sorted((coll / "extensions" / "eda" / "playbooks").glob("*.yml")):
        if (coll / "playbooks" / path.name).exists():
            raise BuildError(f"extensions/eda/playbooks/{path.name}: playbooks/ has one of that name")
        path.rename(coll / "playbooks" / path.name)
    (coll / "extensions" / "eda" / "playbooks").rmdir()
    shutil.copy2(ROOT / "LICENSE", coll / "LICENSE")
    (coll / "galaxy.yml").write_text(_galaxy_yml(version, urls))
    (coll / "README.md").write_text(_template("README.md", version))
    (coll / "meta").mkdir()
    shutil.copy2(HERE / "runtime.yml", coll / "meta" / "runtime.yml")
    shutil.copy2(HERE / "execution-environment.yml", coll / "meta" / "execution-environment.yml")
    (coll / "requirements.txt").write_text(_template("requirements.txt.in", version))
    shutil.copy2(ROOT / "bindep.txt", coll / "bindep.txt")  # the control node's system packages
    (coll / "tests" / "sanity").mkdir(parents=True)
    shutil.copy2(HERE / "config.yml", coll / "tests" / "config.yml")
    ignores = sanity_ignores(coll)
    if ignores:
        (coll / "tests" / "sanity" / f"ignore-{ansible_core_series()}.txt").write_text("".join(ignores))
    shutil.copytree(CHANGELOGS, coll / "changelogs", ignore=SKIP)
    if check_changelog:
        _check_changelog(coll, version, publish)
        _antsibull_changelog(coll, "generate")
    return coll


def sanity_ignores(coll: Path) -> list[str]:
    """The collection's only ansible-test ignores, one line per file, each saying why: scripts a role
    installs on the managed host and runs there with Debian's python3 (`python` does not exist there),
    whose shebang ansible-test's list of allowed ones (only `/usr/bin/env python`) lacks."""
    lines = []
    for path in sorted((coll / "roles").glob("*/files/**/*")):
        if path.is_file():
            with open(path, "rb") as f:
                first = f.readline().strip()
            if first in HOST_PYTHON3_SHEBANGS:
                lines.append(f"{path.relative_to(coll)} shebang # {first.decode()}: runs on the managed host (Debian: "
                             "python3, no `python`); ansible-test allows only `/usr/bin/env python`\n")
    return lines


def build_tarball(coll: Path, dest: Path) -> Path:
    """`ansible-galaxy collection build` of the generated collection into `dest`; the tarball."""
    dest.mkdir(parents=True, exist_ok=True)
    galaxy = Path(sys.executable).parent / "ansible-galaxy"
    subprocess.run([str(galaxy), "collection", "build", "--force", "--output-path", str(dest), str(coll)],
                   check=True, stdout=subprocess.DEVNULL)
    return dest / f"{NAMESPACE}-{NAME}-{project_version()}.tar.gz"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="generate OUT/ansible_collections/hsx/recovery (default: .cache/collection)")
    parser.add_argument("--tarball", action="store_true", help="also build OUT/dist/hsx-recovery-VERSION.tar.gz")
    parser.add_argument("--release", action="store_true",
                        help="release pyproject.toml's version from changelogs/fragments/ into changelogs/changelog.yaml")
    urls = parser.add_mutually_exclusive_group()
    urls.add_argument("--publish", action="store_true",
                      help="the tarball for publishing (implies --tarball): refused unless the version is released "
                           "and pyproject.toml's [project.urls] has Repository, Documentation and Issues")
    urls.add_argument("--placeholder-urls", action="store_true",
                      help=f"missing galaxy.yml URLs as {PLACEHOLDER_URL}/... (Galaxy's import check only)")
    args = parser.parse_args(argv)
    args.tarball = args.tarball or args.publish
    try:
        if args.release:
            coll = release(args.out.resolve())
        else:
            coll = build(args.out.resolve(), publish=args.publish, placeholder_urls=args.placeholder_urls)
    except BuildError as e:
        print(f"collection: {e}", file=sys.stderr)
        return 2
    except ChangelogError as e:
        print(f"collection: {e}", file=sys.stderr)
        return 1
    print(coll)
    if args.tarball:
        print(build_tarball(coll, args.out.resolve() / "dist"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
