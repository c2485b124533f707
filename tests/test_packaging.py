"""The wheel and the sdist: what they ship (the license, ``py.typed``, every module, no tests) and
that building them raises no deprecation warning.

Both are built from a copy of the source tree, so the build's own ``build/`` folder cannot leak
stale modules into the wheel, and with the installed setuptools (no build isolation, no index), so
the test needs no network.
"""

import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from helpers import HANG_GUARD_S

ROOT = Path(__file__).resolve().parent.parent
NAME, VERSION = "s2attn", "0.1.0"

# pyproject.toml's build requirement: SPDX `license` and `license-files` (PEP 639) need 77.
_setuptools_major = int(importlib.metadata.version("setuptools").split(".")[0])
pytestmark = pytest.mark.skipif(
    _setuptools_major < 77, reason="building s2attn needs setuptools>=77 (PEP 639 metadata)"
)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of what a checkout builds from, tests and benchmarks included, so the wheel's
    exclusion of them is checked; benchmark results (plots, JSON) are left out for speed."""
    dest = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "results")
    for name in ("s2attn", "tests", "benchmarks"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


def _modules() -> set[str]:
    """Every module of the package in the source tree, as archive paths (``s2attn/x/y.py``)."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / NAME).rglob("*.py")}


def _run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=HANG_GUARD_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{output}"
    return output


def _deprecations(output: str) -> list[str]:
    return [line for line in output.splitlines() if "deprecat" in line.lower()]


def test_wheel_contents_and_no_deprecation_warning(source, tmp_path):
    # -v: pip hides the backend's output, setuptools' deprecation warnings included, without it.
    output = _run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--no-cache-dir", "-v", "-w", str(tmp_path)],
        cwd=source,
    )
    assert not _deprecations(output), "\n".join(_deprecations(output))
    (wheel,) = tmp_path.glob(f"{NAME}-{VERSION}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = f"{NAME}-{VERSION}.dist-info"
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        license_text = zf.read(f"{dist_info}/licenses/LICENSE").decode()

    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert f"{NAME}/py.typed" in names
    missing = _modules() - names
    assert not missing, f"modules missing from the wheel: {sorted(missing)}"
    tops = {n.split("/")[0] for n in names}
    assert tops == {NAME, dist_info}, f"unexpected top-level entries: {sorted(tops)}"
    assert "License-Expression: Apache-2.0" in metadata
    assert "License-File: LICENSE" in metadata
    # PEP 639: the license expression replaces the classifier, which may not appear beside it.
    assert "Classifier: License ::" not in metadata
    assert "Requires-Python: >=3.11" in metadata
    assert "Project-URL: Repository, https://github.com/s2attn/s2attn" in metadata


def test_sdist_contents_and_no_deprecation_warning(source, tmp_path):
    # The PEP 517 hook that `python -m build --sdist --no-isolation` calls, without needing `build`.
    hook = (
        "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    )
    output = _run([sys.executable, "-c", hook, str(tmp_path)], cwd=source)
    assert not _deprecations(output), "\n".join(_deprecations(output))
    prefix = f"{NAME}-{VERSION}"
    with tarfile.open(tmp_path / f"{prefix}.tar.gz") as tf:
        names = {n.removeprefix(f"{prefix}/") for n in tf.getnames()}
        license_text = tf.extractfile(f"{prefix}/LICENSE").read().decode()
    assert license_text == (ROOT / "LICENSE").read_text()
    assert {"pyproject.toml", "README.md", f"{NAME}/py.typed"} <= names
    missing = _modules() - names
    assert not missing, f"modules missing from the sdist: {sorted(missing)}"
