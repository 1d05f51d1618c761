"""Install each package alone, as its README says, and run that README's python blocks.

For every package, two throwaway environments in a temporary folder:

- ``uv add``: a new uv project (``uv init --bare``) that already depends on torch, then
  ``uv add`` of the package's path, as its README says (uv finds the workspace packages
  it needs beside it);
- ``pip``: a new venv with torch, then plain ``pip install`` of the wheels ``uv build``
  made, in the documented order (a package's workspace dependencies before it, in one
  command: none of them is on an index).

Torch is the one dependency put in first, at the version of the workspace's locked
environment, so uv takes it from its cache instead of downloading 3 GB per environment;
everything else (attrs, numpy, xxhash, safetensors, omegaconf, the packages) is resolved
and installed by ``uv add`` or pip itself. A README block that imports a package the
install did not bring fails here with ``ModuleNotFoundError``.

    uv run python tools/ci/package_alone.py            # every package, both ways
    uv run python tools/ci/package_alone.py dte-codec  # one package

Exit code 0 when every install and every block succeeded; 1 otherwise, naming them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ROOT / "packages"
ORDER = ("dte-detector", "dte-codec", "dte-config", "dte-transport", "areal-dte")
"""Dependency order: each package after the workspace packages it needs."""
NEEDS = {"dte-transport": ("dte-codec",),
         "areal-dte": ("dte-detector", "dte-codec", "dte-config", "dte-transport")}
"""Workspace dependencies of each package (its pyproject's ``dependencies``)."""
NO_TORCH = ("dte-config",)
"""Packages that need no torch: their environments get none."""
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _run(command: list[str], *, cwd: Path | None = None) -> None:
    print("+", " ".join(command), flush=True)  # noqa: T201 - CI log
    subprocess.run(command, cwd=cwd, check=True)


def _blocks(package: str) -> list[str]:
    return [m.group(1) for m in BLOCK.finditer((PACKAGES / package / "README.md").read_text())]


def _examples(python: Path, package: str, scratch: Path) -> None:
    """Run each python block of the package's README with `python` in an empty folder."""
    for number, code in enumerate(_blocks(package), start=1):
        folder = scratch / f"example-{number}"
        folder.mkdir()
        (folder / "example.py").write_text(code)
        _run([str(python), "example.py"], cwd=folder)


def with_uv_add(package: str, tmp: Path, torch: str) -> None:
    """A new uv project; ``uv add`` of the documented path(s); the README's blocks."""
    project = tmp / f"uv-{package}"
    _run(["uv", "init", "--bare", "--no-workspace", "--python", PYTHON, "--name",
          f"try-{package}", str(project)])
    if package not in NO_TORCH:
        _run(["uv", "add", "--project", str(project), f"torch=={torch}"])
    _run(["uv", "add", "--project", str(project), str(PACKAGES / package)])
    _examples(project / ".venv" / "bin" / "python", package, project)


def with_pip(package: str, tmp: Path, torch: str, wheels: Path) -> None:
    """A new venv; plain ``pip install`` of the built wheels in order; the README's blocks."""
    venv = tmp / f"pip-{package}"
    _run(["uv", "venv", "--seed", "--python", PYTHON, str(venv)])
    python = venv / "bin" / "python"
    if package not in NO_TORCH:
        _run(["uv", "pip", "install", "--python", str(python), f"torch=={torch}"])
    files = [next(wheels.glob(f"{name.replace('-', '_')}-*.whl"))
             for name in (*NEEDS.get(package, ()), package)]
    _run([str(python), "-m", "pip", "install", "--quiet", *map(str, files)])
    _examples(python, package, venv)


def main(argv: list[str] | None = None) -> int:
    """Both installs of each chosen package; 1 when any failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("packages", nargs="*", metavar="PACKAGE",
                   help=f"default: all of {', '.join(ORDER)}")
    chosen = p.parse_args(argv).packages or list(ORDER)
    unknown = sorted(set(chosen) - set(ORDER))
    if unknown:
        p.error(f"unknown packages {unknown}; choose from {', '.join(ORDER)}")
    torch = importlib.metadata.version("torch")
    failed = []
    with tempfile.TemporaryDirectory(prefix="package-alone-") as folder:
        tmp = Path(folder)
        wheels = tmp / "wheels"
        for name in ORDER:
            _run(["uv", "build", "--wheel", "--quiet", "--package", name, "--out-dir",
                  str(wheels)], cwd=ROOT)
        for package in chosen:
            for how, install in (("uv add", lambda: with_uv_add(package, tmp, torch)),
                                 ("pip", lambda: with_pip(package, tmp, torch, wheels))):
                started = time.perf_counter()
                try:
                    install()
                except subprocess.CalledProcessError as exc:
                    failed.append(f"{package} ({how}): {' '.join(exc.cmd)} exited {exc.returncode}")
                print(f"== {package} ({how}): {time.perf_counter() - started:.0f} s",  # noqa: T201
                      flush=True)
    for line in failed:
        print(f"FAILED {line}", file=sys.stderr)  # noqa: T201
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
