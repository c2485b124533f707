"""The README's code runs as written: every ```python block in a fresh interpreter, and every
``python -m s2attn`` command line, each from an empty directory and without the Triton
interpreter, as a user on a CPU would run them."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HANG_GUARD_S

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(language: str) -> list[str]:
    return [body for lang, body in _FENCE.findall(README.read_text()) if lang == language]


def _cli_lines() -> list[str]:
    """The ``python -m s2attn`` commands of bash blocks and of inline code, each once; ``train``
    and ``eval`` (minutes on a CPU) reduced to their ``--help``, which checks that the subcommand
    exists and that its module imports."""
    text = README.read_text()
    found = [m.group(1) for m in re.finditer(r"`(python -m s2attn [^`]+)`", text)]
    for body in _blocks("bash"):
        found += [line.split("#", 1)[0].strip() for line in body.splitlines()]
    lines = []
    for line in found:
        if not line.startswith("python -m s2attn "):
            continue
        words = line.split()
        if words[3] in ("train", "eval"):
            line = " ".join(words[:4] + ["--help"])
        if line not in lines:
            lines.append(line)
    return lines


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    # The checkout's package, wherever the test runs from; no kernel-output poisoning, which is a
    # test aid and not what a user sees.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("S2ATTN_POISON_OUTPUTS", None)
    return env


def _run(args: list[str], cwd: Path) -> None:
    result = subprocess.run(
        args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert result.returncode == 0, (
        f"{shlex.join(args)} exited with {result.returncode}\n"
        f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )


def test_readme_has_code_to_run():
    # The test below must see the README's blocks: a fence spelled differently would skip them.
    assert len(_blocks("python")) >= 3
    assert {line.split()[3] for line in _cli_lines()} >= {"draw", "train", "eval"}


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_block_runs(index, tmp_path):
    if "transformers" in _blocks("python")[index]:
        pytest.importorskip("transformers")
    script = tmp_path / f"readme_{index}.py"
    script.write_text(_blocks("python")[index])
    _run([sys.executable, str(script)], tmp_path)


@pytest.mark.parametrize("line", _cli_lines())
def test_cli_line_runs(line, tmp_path):
    args = shlex.split(line)[1:]  # the README says ``python``; run this interpreter
    if args[2] in ("train", "eval"):
        pytest.importorskip("transformers")
    _run([sys.executable, *args], tmp_path)
