"""Where the control node's playbooks and modules come from - the one answer for `hsx recover`,
`takeover`, `provision`, `rollout-patch` (extraction/fleet/playbook.py) and `hsx fleet-status` (its
ad-hoc module, extraction/fleet/fleetstatus.py).

- A checkout: the folder two above this package (`repo`: an editable install) has ansible.cfg and
  playbooks/. Its playbooks run by path, with its ansible.cfg, library/, module_utils/ and roles/, as
  they always did; reports default to `repo`/reports. A checkout without the playbook asked for is an
  error (nothing else is run in its place).
- Installed (a wheel - hsx-control in the execution environment - with no checkout): the collection
  hsx.recovery where ansible-core looks for one, in its order (`search_roots`): the configured
  collections path - ANSIBLE_COLLECTIONS_PATH (or the older ANSIBLE_COLLECTIONS_PATHS), else the
  `collections_path` of the ansible.cfg ansible-core reads (ANSIBLE_CONFIG, ./ansible.cfg unless the
  folder is world-writable, ~/.ansible.cfg, /etc/ansible/ansible.cfg), else $ANSIBLE_HOME/collections
  (~/.ansible/collections) and /usr/share/ansible/collections - then each sys.path entry (Python's
  site-packages) unless collections_scan_sys_path is off. The first `ansible_collections/hsx/recovery`
  found is the one ansible-core loads, and the one used: playbooks and the module by FQCN
  (hsx.recovery.recover, hsx.recovery.extraction_status_info), with the operator's own Ansible
  configuration; ansible-playbook gets the searched path as ANSIBLE_COLLECTIONS_PATH, so that it
  finds the same copy. Reports default to $XDG_STATE_HOME/hsx/reports (~/.local/state/hsx/reports).
- Neither: OperatorError naming what was looked for and where (the commands exit 2).
"""

from __future__ import annotations

import configparser
import json
import os
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

NAMESPACE, NAME = "hsx", "recovery"
COLLECTION = f"{NAMESPACE}.{NAME}"
TRUE = {"y", "yes", "on", "1", "true", "t"}  # ansible-core's boolean()


class OperatorError(RuntimeError):
    """Bad input or a missing piece; the message names what and where (exit 2)."""


def is_checkout(repo: Path) -> bool:
    """`repo` is a source checkout (its ansible.cfg and playbooks/), not the lib/ of an installed package."""
    return (repo / "ansible.cfg").is_file() and (repo / "playbooks").is_dir()


def installed_reports(env: Mapping[str, str] | None = None) -> Path:
    """Reports of an installed hsx: $XDG_STATE_HOME/hsx/reports, else ~/.local/state/hsx/reports."""
    env = os.environ if env is None else env
    return Path(env.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "hsx" / "reports"


def default_reports(repo: Path) -> Path:
    """Where reports go without --report-dir: the checkout's reports/, else installed_reports()."""
    return repo / "reports" if is_checkout(repo) else installed_reports()


def _resolve(path: str, base: Path | None) -> Path:
    """ansible-core's resolve_path for one entry of a pathspec: ~ and $VARS expanded, a relative path
    taken from `base` (an ansible.cfg's folder) or the current directory."""
    p = Path(os.path.expandvars(os.path.expanduser(path)))
    return Path(os.path.normpath((base or Path.cwd()) / p))


def ansible_config(env: Mapping[str, str]) -> Path | None:
    """The ansible.cfg ansible-core reads, searched as it searches (find_ini_config_file); None: none."""
    candidates = []
    if "ANSIBLE_CONFIG" in env:
        given = _resolve(env["ANSIBLE_CONFIG"], None)
        candidates.append(given / "ansible.cfg" if given.is_dir() else given)
    try:
        cwd = Path.cwd()
        if not cwd.stat().st_mode & stat.S_IWOTH:  # ansible-core ignores a world-writable folder's
            candidates.append(cwd / "ansible.cfg")
    except OSError:
        pass
    candidates += [Path.home() / ".ansible.cfg", Path("/etc/ansible/ansible.cfg")]
    return next((c for c in candidates if c.is_file() and os.access(c, os.R_OK)), None)


def _ini(config: Path | None) -> dict[str, str]:
    """[defaults] of `config` (ansible-core's parser: `;` starts an inline comment); {} if unreadable."""
    if config is None:
        return {}
    parser = configparser.ConfigParser(inline_comment_prefixes=(";",), interpolation=None)
    try:
        parser.read(config, encoding="utf-8")
    except (configparser.Error, OSError, UnicodeDecodeError):
        return {}
    return dict(parser["defaults"]) if parser.has_section("defaults") else {}


@dataclass(frozen=True)
class Search:
    """Where ansible-core looks for collections: `configured` (each with why), then `sys_path` ones."""

    configured: tuple[tuple[Path, str], ...]
    sys_path: tuple[Path, ...]
    config: Path | None

    def roots(self) -> list[tuple[Path, str]]:
        return [*self.configured, *((p, "sys.path") for p in self.sys_path)]


def search_roots(env: Mapping[str, str] | None = None, path: Sequence[str] | None = None) -> Search:
    """The collection roots ansible-core searches, in its order (module docstring); `env` and `path`
    default to os.environ and sys.path."""
    env = os.environ if env is None else env
    config = ansible_config(env)
    ini, base = _ini(config), config.parent if config else None
    spec, why, spec_base = None, "", None
    for var in ("ANSIBLE_COLLECTIONS_PATH", "ANSIBLE_COLLECTIONS_PATHS"):  # the second: ansible-core < 2.19
        if env.get(var):
            spec, why = env[var], var
            break
    else:
        for key in ("collections_path", "collections_paths"):
            if ini.get(key):
                spec, why, spec_base = ini[key], f"{config} collections_path", base
                break
    if spec is None:
        home = _resolve(env["ANSIBLE_HOME"], None) if env.get("ANSIBLE_HOME") else (
            _resolve(ini["home"], base) if ini.get("home") else Path.home() / ".ansible")
        configured = [(home / "collections", "default"), (Path("/usr/share/ansible/collections"), "default")]
    else:
        configured = [(_resolve(p, spec_base), why) for p in spec.split(os.pathsep) if p]
    # ansible-core takes a configured `.../ansible_collections` as its parent
    configured = [(p.parent if p.name == "ansible_collections" else p, w) for p, w in configured]
    scan = env.get("ANSIBLE_COLLECTIONS_SCAN_SYS_PATH", ini.get("collections_scan_sys_path", "true"))
    sys_roots = [Path(p or ".").resolve() for p in (sys.path if path is None else path)]
    return Search(tuple(configured), tuple(sys_roots) if scan.strip().lower() in TRUE else (), config)


def collection_version(coll: Path) -> str:
    """The installed collection's version (MANIFEST.json, else galaxy.yml), '?' when neither says."""
    try:
        return str(json.loads((coll / "MANIFEST.json").read_text())["collection_info"]["version"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        for line in (coll / "galaxy.yml").read_text().splitlines():
            if line.startswith("version:"):
                return line.split(":", 1)[1].strip().strip("'\"")
    except OSError:
        pass
    return "?"


@dataclass(frozen=True)
class Source:
    """Where the playbooks are: a checkout (`checkout`), or the installed collection (`collection`)."""

    checkout: Path | None = None
    collection: Path | None = None
    search: Search | None = None

    def playbook(self, name: str) -> str:
        """What ansible-playbook is given for playbooks/`name`: its path, or the collection's FQCN."""
        if self.checkout is not None:
            return str(self.checkout / "playbooks" / name)
        return f"{COLLECTION}.{Path(name).stem}"

    def module(self, name: str) -> str:
        """An hsx module's name for an ad-hoc run: short in a checkout (its library/), else the FQCN."""
        return name if self.checkout is not None else f"{COLLECTION}.{name}"

    def project_dir(self) -> Path:
        """Where ansible-playbook runs: the checkout; installed, where the operator is (their ansible.cfg)."""
        return self.checkout if self.checkout is not None else Path.cwd()

    def env(self) -> dict[str, str]:
        """What ansible-playbook needs to find our config, content and the `hsx` next to this Python."""
        bin_dir = str(Path(sys.executable).parent)
        env = {"ANSIBLE_NOCOLOR": "1", "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
        if self.checkout is not None:
            return {
                "ANSIBLE_CONFIG": str(self.checkout / "ansible.cfg"),
                "ANSIBLE_LIBRARY": str(self.checkout / "library"),
                "ANSIBLE_MODULE_UTILS": str(self.checkout / "module_utils"),
                "ANSIBLE_ROLES_PATH": str(self.checkout / "roles"),
                **env,
            }
        if self.search is not None:
            # the operator's own configuration, wherever ansible-runner starts it; the path searched here
            if self.search.config is not None:
                env["ANSIBLE_CONFIG"] = str(self.search.config)
            env["ANSIBLE_COLLECTIONS_PATH"] = os.pathsep.join(str(p) for p, _ in self.search.configured)
        return env

    def describe(self) -> str:
        if self.checkout is not None:
            return f"the checkout {self.checkout}"
        return f"{COLLECTION} {collection_version(self.collection)} installed at {self.collection}"


def locate(repo: Path, playbook: str | None = None, env: Mapping[str, str] | None = None,
           path: Sequence[str] | None = None) -> Source:
    """The Source for `playbook` (a file of playbooks/, e.g. "recover.yml"; None: the modules only):
    the checkout `repo` when hsx runs from one, else the first installed hsx.recovery ansible-core
    would load (search_roots). OperatorError when the checkout lacks the playbook, when no collection
    is found (naming each place looked in) or when the one found lacks the playbook."""
    if is_checkout(repo):
        if playbook and not (repo / "playbooks" / playbook).is_file():
            raise OperatorError(f"playbooks/{playbook} does not exist: this checkout ({repo}) has no such playbook "
                                "yet. Nothing was run")
        return Source(checkout=repo)
    search = search_roots(env, path)
    roots = search.roots()
    found = next((r / "ansible_collections" / NAMESPACE / NAME for r, _ in roots
                  if (r / "ansible_collections" / NAMESPACE / NAME).is_dir()), None)
    if found is None:
        looked = "; ".join(f"{r}/ansible_collections ({why})" for r, why in roots) or "nowhere (no path configured)"
        raise OperatorError(
            f"hsx runs from no checkout ({repo} has no ansible.cfg and playbooks/) and found no installed "
            f"collection {COLLECTION} (ansible_collections/{NAMESPACE}/{NAME}) where ansible-core looks: {looked}. "
            f"Install it (ansible-galaxy collection install hsx-recovery-VERSION.tar.gz), or name where it is with "
            f"ANSIBLE_COLLECTIONS_PATH. Nothing was run")
    source = Source(collection=found, search=search)
    if playbook and not (found / "playbooks" / playbook).is_file():
        raise OperatorError(
            f"{source.describe()} has no playbooks/{playbook} ({source.playbook(playbook)}): install the "
            f"collection of this hsx's release there, or ahead of it in ANSIBLE_COLLECTIONS_PATH. Nothing was run")
    return source
