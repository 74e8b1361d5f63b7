"""Wheels for the GPU check's machine: what its image lacks, fetched here, installed there offline.

The GPU machines' image has Python 3.12 with torch, transformers, aiohttp, prometheus-client,
nvidia-ml-py, grpcio, protobuf, pyyaml, requests, ... (IMAGE below) but not `kubernetes` nor
`structlog`, and no network. Run this where the package index is reachable:

    python -m gpu_watchdog.benchmarks.gpu_wheels [DIR]      # default .gpu-wheels/ (git-ignored)

It downloads Python 3.12 / manylinux x86_64 wheels of ROOTS and of every requirement they name
(read from each wheel's METADATA, markers evaluated for that machine) that the image does not
hold, one version of each. `benchmarks/gpu_check.sh` installs the folder with
`pip install --no-index --no-deps --target` and never reaches for the network when it is there.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
ROOTS = ("kubernetes", "structlog")
PYTHON = "3.12"  # the GPU machines' python3
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def environment(python: str) -> dict[str, str]:
    """The Linux x86_64 machine the check runs on: what requirements' markers are evaluated against."""
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


# What the GPU machines' image already holds (as read there, 2026-11): never carried.
IMAGE = frozenset(canonicalize_name(n) for n in """
aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click
cloudpickle filelock frozenlist fsspec grpcio h11 hf-xet httpcore httpx huggingface-hub hypothesis idna jinja2
markupsafe matplotlib mdurl msgpack multidict numpy nvidia-ml-py packaging pillow pip pluggy prometheus-client
propcache protobuf psutil pygments pyparsing pytest pytest-timeout python-dateutil pyyaml regex requests rich
safetensors setuptools six sympy tokenizers torch tqdm transformers typing-extensions urllib3 wheel yarl zipp
""".split())


def download(name: str, spec: str, into: Path, python: str) -> Path:
    before = set(into.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(into)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, f"{name}{spec}"], check=True)
    new = set(into.glob("*.whl")) - before
    if not new:  # already there from an earlier run
        new = {w for w in into.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == canonicalize_name(name)}
    return sorted(new)[-1]


def requirements(wheel: Path, python: str) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if re.match(r"[^/]+\.dist-info/METADATA$", n))
        text = z.read(meta).decode("utf-8", errors="replace")
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(environment(python)):  # `extra == ...` is False here
                reqs.append(req)
    return reqs


def collect(into: Path, python: str = PYTHON) -> dict[str, Path]:
    into.mkdir(parents=True, exist_ok=True)
    wanted: list[tuple[str, str]] = [(name, "") for name in ROOTS]
    got: dict[str, Path] = {}
    while wanted:
        name, spec = wanted.pop(0)
        key = canonicalize_name(name)
        if key in got or key in IMAGE:
            continue
        got[key] = download(name, spec, into, python)
        for req in requirements(got[key], python):
            wanted.append((req.name, str(req.specifier)))
    for stray in into.glob("*.whl"):  # one version of each: leave nothing an earlier run left
        if stray not in got.values():
            stray.unlink()
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", nargs="?", default=str(ROOT / ".gpu-wheels"))
    p.add_argument("--python-version", default=PYTHON, help="of the machine that installs them (default %(default)s)")
    a = p.parse_args()
    into = Path(a.directory)
    got = collect(into, a.python_version)
    total = sum(w.stat().st_size for w in got.values())
    for _, wheel in sorted(got.items()):
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    print(f"{len(got)} wheels, {total / 2**20:.1f} MiB in {into}")


if __name__ == "__main__":
    main()
