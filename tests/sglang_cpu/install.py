"""Install the released SGLang 0.5.23 into its own venv OUTSIDE the checkout, for its CPU path.

    python tests/sglang_cpu/install.py              # install, or a cache hit (prints where and why)
    python tests/sglang_cpu/install.py --resolve    # rewrite constraints.txt from sglang's metadata

Where: $HSX_SGLANG_CPU_VENV, else /var/cache/hsx/sglang-0.5.23-cpu (`--venv` overrides both).

What: every package of `constraints.txt` (beside this file), each pinned `name==version`, installed
with `pip install --no-deps --only-binary=:all:` - exactly that list, nothing resolved at install
time. The list is SGLang 0.5.23's requirements closed over their own, less the GPU-only
requirements in GPU_ONLY (CUDA kernel libraries: they cannot run without a GPU, and leaving them
out saves ~4 GB; ../shared/DESIGN.md section 12). torch 2.14.1 keeps its own (CUDA runtime wheels
included): its default wheel imports them at start, GPU or not, and CPU-only torch cannot be used
because sglang imports torchvision, whose wheels link the CUDA torch.

Checks after installing: `pip check` may name only the GPU_ONLY packages as missing (anything
else - a version conflict, another missing name - fails the install), and `import sglang` in the
venv must give version 0.5.23. Only then is the stamp written: `.hsx-sglang-cpu.json` in the venv,
recording the pins' SHA-256, the Python, and the install's time and size. A later run whose pins
and Python match the stamp is a cache hit and does nothing else. A venv of ours without a matching
stamp (an older list, an interrupted or refused install) is brought to the list: the pins installed
again (pip keeps what already matches), any package not on the list uninstalled, and the venv's
packages then compared with the list, name and version, before the checks above. A directory this
script did not make (no `.hsx-sglang-cpu-venv` in it) is refused, never changed; so is a venv made
by another Python (removed and made again only when it carries our mark).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONSTRAINTS = HERE / "constraints.txt"
SGLANG_VERSION = "0.5.23"
DEFAULT_VENV = Path(f"/var/cache/hsx/sglang-{SGLANG_VERSION}-cpu")
STAMP = ".hsx-sglang-cpu.json"
OWNER_MARK = ".hsx-sglang-cpu-venv"
# sglang 0.5.23's requirements that only a GPU can use: left out of the venv (pip check names them).
GPU_ONLY = frozenset(
    {
        "flash-attn-4",
        "flashinfer-python",
        "humming-kernels",
        "cuda-python",
        "nvidia-cutlass-dsl",
        "nvidia-mathdx",
        "nvshmem4py-cu13",
        "quack-kernels",
        "sgl-deep-ep",
        "sgl-deep-gemm",
        "sgl-flash-mla",
        "sglang-kernel",
        "tilelang",
        "torch-memory-saver",
    }
)
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")


def canon(name: str) -> str:
    """A distribution name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def default_venv() -> Path:
    return Path(os.environ.get("HSX_SGLANG_CPU_VENV") or DEFAULT_VENV)


def read_pins(path: Path = CONSTRAINTS) -> list[str]:
    """The `name==version` lines of the constraints file; anything else but comments is an error."""
    pins = []
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not _PIN.match(line):
            raise SystemExit(f"{path}:{no}: not a `name==version` pin: {raw!r}")
        pins.append(line)
    if not any(canon(p.split("==")[0]) == "sglang" for p in pins):
        raise SystemExit(f"{path}: sglang is not pinned")
    return pins


def stamp_key(pins: list[str]) -> dict:
    """What a cache hit must match: the pins and the interpreter's version."""
    return {
        "pins_sha256": hashlib.sha256("\n".join(pins).encode()).hexdigest(),
        "python": "{}.{}".format(*sys.version_info[:2]),
    }


def cached(venv: Path, key: dict) -> dict | None:
    """The stamp of a finished install with these pins, or None."""
    try:
        stamp = json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return None
    ok = all(stamp.get(k) == v for k, v in key.items()) and (venv / "bin" / "python").exists()
    return stamp if ok else None


def du(path: Path) -> int:
    """Bytes on disk under path (links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def ensure_venv(venv: Path) -> None:
    """Create the venv, or keep ours if it runs this Python; never touch a directory not ours."""
    if venv.is_symlink():
        raise SystemExit(f"{venv} is a symbolic link: refused (point HSX_SGLANG_CPU_VENV at a directory)")
    if venv.exists() and any(venv.iterdir()):
        if not (venv / OWNER_MARK).is_file():
            raise SystemExit(
                f"{venv} exists and was not made by this script (no {OWNER_MARK}): "
                "refused; remove it or choose another HSX_SGLANG_CPU_VENV"
            )
        ours = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sys; print(sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
        if ours.returncode == 0 and ours.stdout.strip() == str(sys.version_info[:2]):
            print(f"bringing the venv {venv} to {CONSTRAINTS.name}", flush=True)
            return
        print(f"removing {venv}: made by another Python", flush=True)
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    (venv / OWNER_MARK).write_text("made by tests/sglang_cpu/install.py\n")


def installed(py: Path) -> dict[str, str]:
    """canonical name -> version of every distribution in the venv."""
    out = subprocess.run(
        [str(py), "-m", "pip", "list", "--format=json"], check=True, capture_output=True, text=True
    ).stdout
    return {canon(d["name"]): d["version"] for d in json.loads(out)}


def converge(py: Path, pins: list[str], env: dict[str, str]) -> None:
    """Install the pins (no resolving), uninstall what is not on the list, then compare."""
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:", "-r", str(CONSTRAINTS)],
        check=True,
        env=env,
    )
    want = {canon(n): v for n, v in (p.split("==") for p in pins)}
    extra = sorted(set(installed(py)) - set(want) - {"pip"})
    if extra:
        print(f"uninstalling what is not pinned: {' '.join(extra)}", flush=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", *extra], check=True, env=env)
    have = installed(py)
    wrong = [
        f"{n}: {have.get(n, 'missing')} (pinned {v})" for n, v in sorted(want.items()) if have.get(n) != v
    ]
    if wrong:
        raise SystemExit("sglang-cpu venv: not what constraints.txt pins:\n  " + "\n  ".join(wrong))


def pip_check_problems(py: Path) -> list[str]:
    """`pip check` lines other than 'sglang requires <GPU_ONLY name>, which is not installed'."""
    out = subprocess.run([str(py), "-m", "pip", "check"], capture_output=True, text=True).stdout
    missing = re.compile(r"^sglang [^ ]+ requires ([^ ,]+), which is not installed\.$")
    bad = []
    for line in out.splitlines():
        m = missing.match(line.strip())
        if (
            not (m and canon(m.group(1)) in GPU_ONLY)
            and line.strip()
            and line.strip() != "No broken requirements found."
        ):
            bad.append(line.strip())
    return bad


def install(venv: Path) -> int:
    pins = read_pins()
    key = stamp_key(pins)
    hit = cached(venv, key)
    if hit:
        print(
            f"sglang-cpu venv: cache hit at {venv} ({len(pins)} pins; installed in "
            f"{hit['seconds']:.0f} s, {hit['bytes'] / 1e9:.2f} GB)"
        )
        return 0
    t0 = time.monotonic()
    ensure_venv(venv)
    (venv / STAMP).unlink(missing_ok=True)
    py = venv / "bin" / "python"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    converge(py, pins, env)
    bad = pip_check_problems(py)
    if bad:
        raise SystemExit(
            "sglang-cpu venv: pip check found more than the GPU-only packages left out:\n  "
            + "\n  ".join(bad)
        )
    got = subprocess.run(
        [str(py), "-c", "import sglang; print(sglang.__version__)"],
        capture_output=True,
        text=True,
        env=dict(env, SGLANG_USE_CPU_ENGINE="1"),
    )
    if got.returncode or got.stdout.strip() != SGLANG_VERSION:
        raise SystemExit(
            f"sglang-cpu venv: `import sglang` gave {got.stdout.strip()!r} "
            f"(rc {got.returncode}): {got.stderr.strip()[-2000:]}"
        )
    seconds, size = time.monotonic() - t0, du(venv)
    (venv / STAMP).write_text(
        json.dumps(dict(key, pins=pins, seconds=round(seconds, 1), bytes=size), indent=1) + "\n"
    )
    print(
        f"sglang-cpu venv: installed {len(pins)} packages at {venv} in {seconds:.0f} s, "
        f"{size / 1e9:.2f} GB on disk"
    )
    return 0


def resolve() -> int:
    """Rewrite constraints.txt: sglang's own requirements less GPU_ONLY, resolved by pip (dry run)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "-d",
                tmp,
                f"sglang=={SGLANG_VERSION}",
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("sglang-*.whl"))
        meta = zipfile.ZipFile(wheel).read(f"sglang-{SGLANG_VERSION}.dist-info/METADATA").decode()
        reqs = [line.split(": ", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
        reqs = [
            r
            for r in reqs
            if "extra ==" not in r and canon(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) not in GPU_ONLY
        ]
        (Path(tmp) / "reqs.txt").write_text("\n".join(reqs) + "\n")
        subprocess.run([sys.executable, "-m", "venv", f"{tmp}/v"], check=True)
        subprocess.run(
            [
                f"{tmp}/v/bin/pip",
                "install",
                "-q",
                "--dry-run",
                "--ignore-installed",
                "--only-binary=:all:",
                "--report",
                f"{tmp}/r.json",
                "-r",
                f"{tmp}/reqs.txt",
            ],
            check=True,
        )
        got = json.loads(Path(f"{tmp}/r.json").read_text())["install"]
    pins = sorted(
        {f"{canon(i['metadata']['name'])}=={i['metadata']['version']}" for i in got}
        | {f"sglang=={SGLANG_VERSION}"}
    )
    head = [line for line in CONSTRAINTS.read_text().splitlines() if line.startswith("#")]
    CONSTRAINTS.write_text("\n".join(head + pins) + "\n")
    print(f"{CONSTRAINTS}: {len(pins)} pins")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--venv", type=Path, default=None, help="default: $HSX_SGLANG_CPU_VENV or " + str(DEFAULT_VENV)
    )
    ap.add_argument("--resolve", action="store_true", help="rewrite constraints.txt (needs the registry)")
    args = ap.parse_args(argv)
    return resolve() if args.resolve else install(args.venv or default_venv())


if __name__ == "__main__":
    sys.exit(main())
