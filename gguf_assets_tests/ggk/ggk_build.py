"""ggk's engine, built from its PyPI sdist once per machine and ggk version, cached outside the clone.

The suite's outside reader of every file the product makes (test_ggk_runtime.py). `scripts/test.sh` runs this
module before the tests, so the 10-minute suite holds after the first build (about 4 minutes on 2 cores); a test
that finds no binary builds it here too, under a file lock, so two test processes never build twice.

    python gguf_assets_tests/ggk/ggk_build.py     # prints the binary's path, building it if needed

Cache: $GGUF_ASSETS_GGK_CACHE, else ~/.cache/gguf_assets/ggk-<version>/ (the unpacked sdist in src/, the binary in
bin/diffusion). Needs cmake, ninja and a C++ compiler (.ci/run installs them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from filelock import FileLock

GGK_VERSION = "0.9.7"  # the version ggk_contract.py was read from (a test ties the two)
TARGET = "diffusion-cli"


def cache_dir() -> Path:
    base = os.environ.get("GGUF_ASSETS_GGK_CACHE") or str(Path.home() / ".cache" / "gguf_assets" / f"ggk-{GGK_VERSION}")
    return Path(base)


def source_dir() -> Path:
    """The unpacked sdist (its vendor/engine holds the engine's source)."""
    return cache_dir() / "src"


def binary_path() -> Path:
    return cache_dir() / "bin" / "diffusion"


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "ab") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}); the end of {log}:\n{tail}")


def _fetch_source(log: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="ggk-sdist-") as tmp:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
              f"ggk=={GGK_VERSION}", "-d", tmp], log)
        (sdist,) = Path(tmp).glob("ggk-*.tar.gz")
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(sdist) as archive:
            archive.extractall(unpacked, filter="data")
        (top,) = unpacked.iterdir()
        shutil.rmtree(source_dir(), ignore_errors=True)
        os.replace(top, source_dir())


def ggk_binary() -> Path:
    """The engine binary, built first when this machine has none of this version."""
    binary = binary_path()
    if binary.is_file():
        return binary
    cache_dir().mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir() / "build.lock")):
        if binary.is_file():  # another process built it while this one waited
            return binary
        log = cache_dir() / "build.log"
        log.write_text("")
        began = time.monotonic()
        if not (source_dir() / "vendor" / "engine" / "CMakeLists.txt").is_file():
            _fetch_source(log)
        build = cache_dir() / "build"
        _run(["cmake", "-S", str(source_dir() / "vendor" / "engine"), "-B", str(build), "-G", "Ninja",
              "-DCMAKE_BUILD_TYPE=Release"], log)
        _run(["cmake", "--build", str(build), "--target", TARGET, "-j", str(os.cpu_count() or 2)], log)
        (built,) = [p for p in build.rglob("diffusion") if p.is_file() and os.access(p, os.X_OK)]
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_name(".diffusion.tmp")
        shutil.copy2(built, tmp)
        os.replace(tmp, binary)  # the binary appears whole, or not at all
        shutil.rmtree(build, ignore_errors=True)  # 1 GB of objects; the source stays for the contract tests
        with open(log, "a") as out:
            out.write(f"built {binary} in {time.monotonic() - began:.0f} s\n")
    return binary


if __name__ == "__main__":
    began = time.monotonic()
    fresh = not binary_path().is_file()
    path = ggk_binary()
    print(f"ggk {GGK_VERSION}: {path}" + (f" (built in {time.monotonic() - began:.0f} s)" if fresh else " (cached)"))
