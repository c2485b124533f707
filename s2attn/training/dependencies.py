"""What the model commands need beyond s2attn's own dependencies: the ``models`` extra of
``pyproject.toml``, checked before a command imports or does anything, so that no run is lost to
a package missing halfway through.

transformers (the model) and tqdm (progress) are required; matplotlib only draws the pictures
(``curves.png``, the needle heat map), so without it the commands still run, and say up front
that they will not draw them. Importable without any of the three.
"""

from __future__ import annotations

import importlib

__all__ = ["INSTALL", "OPTIONAL", "REQUIRED", "missing", "missing_required"]

INSTALL = "pip install 's2attn[models]'"
# The `models` extra, as (module, lowest major version or None): pyproject.toml lists the same.
REQUIRED = (("transformers", 5), ("tqdm", None))
OPTIONAL = (("matplotlib", None),)


def missing(requirements: tuple[tuple[str, int | None], ...]) -> list[str]:
    """The modules of ``requirements`` that cannot be imported, or are older than their major
    version, each with the reason: ``"tqdm (not installed)"``, ``"transformers >= 5 (4.57.1
    installed)"``."""
    absent = []
    for name, major in requirements:
        try:
            module = importlib.import_module(name)
        except ImportError:
            absent.append(f"{name} (not installed)")
            continue
        first = str(getattr(module, "__version__", "")).split(".")[0]
        if major is not None and first.isdigit() and int(first) < major:
            absent.append(f"{name} >= {major} ({module.__version__} installed)")
    return absent


def missing_required(command: str) -> str | None:
    """What ``s2attn COMMAND`` says when a required module is missing, else None."""
    absent = missing(REQUIRED)
    if not absent:
        return None
    return f"`s2attn {command}` needs {' and '.join(absent)}: {INSTALL}"
