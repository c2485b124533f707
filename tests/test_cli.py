"""The ``s2attn`` command line, run in-process through ``s2attn.cli.main``: help texts, usage
errors for bad ``demo`` and ``draw`` values, the legend of ``draw``, and a tiny ``demo``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import HANG_GUARD_S

from s2attn import cli


def _run(argv, capsys):
    """(exit status, stdout, stderr) of ``s2attn ARGV``; argparse exits through SystemExit."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _option_entries(help_text: str) -> dict[str, str]:
    """Each option's entry in an argparse help text, keyed by its first flag: the line that names
    it and the more deeply indented lines that continue its help."""
    entries: dict[str, str] = {}
    flag = None
    for line in help_text.split("options:", 1)[1].splitlines():
        match = re.match(r"  (-[-\w]+)", line)
        if match:
            flag = match.group(1)
            entries[flag] = line
        elif flag and line.startswith("    "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


def test_top_level_help_is_whole_and_plain(capsys):
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    assert "``" not in out
    # The description ends its sentence rather than stopping at a docstring's first line.
    assert "train and evaluate HHST language models." in out
    for command in ("demo", "draw", "train", "eval"):
        assert re.search(rf"^\s+{command}\s+\S", out, re.M), f"{command} not listed:\n{out}"
    assert "examples:" in out and "s2attn draw --heads 4" in out


def test_python_dash_m_help():
    proc = subprocess.run(
        [sys.executable, "-m", "s2attn", "--help"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert "``" not in proc.stdout
    assert "usage: s2attn" in proc.stdout and "examples:" in proc.stdout


@pytest.mark.parametrize(
    "command, flags",
    [
        ("demo", {"--layers", "--dense-layers", "--seq"}),
        (
            "draw",
            {"--heads", "--seq", "--block", "--local-blocks", "--vert-stride", "--bidirectional"}
            | {"--show-heads"},
        ),
    ],
)
def test_help_gives_every_option_a_default(command, flags, capsys):
    code, out, _ = _run([command, "--help"], capsys)
    assert code == 0
    assert "``" not in out
    entries = _option_entries(out)
    assert set(entries) == flags | {"-h"}, out
    for flag in flags:
        assert "(default: " in entries[flag], f"{flag} states no default: {entries[flag]!r}"


@pytest.mark.parametrize(
    "argv, flag, message",
    [
        (["demo", "--layers", "0"], "--layers", "must be an integer >= 1"),
        (["demo", "--layers", "two"], "--layers", "must be an integer >= 1"),
        (["demo", "--dense-layers", "-1"], "--dense-layers", "must be an integer >= 0"),
        (["demo", "--layers", "2", "--dense-layers", "5"], "--dense-layers", "less than --layers"),
        (["demo", "--layers", "2", "--dense-layers", "2"], "--dense-layers", "less than --layers"),
        (["demo", "--seq", "0"], "--seq", "must be an integer >= 1"),
        (["draw", "--heads", "0"], "--heads", "must be an integer >= 1"),
        (["draw", "--heads", "-4"], "--heads", "must be an integer >= 1"),
        (["draw", "--seq", "0"], "--seq", "must be an integer >= 1"),
        (["draw", "--seq", "-2048"], "--seq", "must be an integer >= 1"),
        (["draw", "--block", "48"], "--block", "power of two >= 16"),
        (["draw", "--block", "8"], "--block", "power of two >= 16"),
        (["draw", "--block", "0"], "--block", "power of two >= 16"),
        (["draw", "--local-blocks", "0"], "--local-blocks", "must be an integer >= 1"),
        (["draw", "--vert-stride", "0"], "--vert-stride", "must be an integer >= 1"),
        (["draw", "--vert-stride", "-1"], "--vert-stride", "must be an integer >= 1"),
        (["draw", "--show-heads", "0"], "--show-heads", "must be an integer >= 1"),
        (["draw", "--heads", "2", "--show-heads", "3"], "--show-heads", "at most --heads (2)"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_option(argv, flag, message, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2, (out, err)
    assert f"s2attn {argv[0]}: error: argument {flag}: " in err, err
    assert message in err, err
    assert "Traceback" not in err


def _pictures(out: str) -> dict[int, list[str]]:
    """The rows of each head's picture in ``draw``'s output, keyed by head."""
    pictures: dict[int, list[str]] = {}
    for block in out.split("\nhead ")[1:]:
        title, *rows = block.split("\n")
        pictures[int(title.rstrip(":"))] = [r for r in rows if r]
    return pictures


@pytest.mark.parametrize("bidirectional", [False, True])
def test_draw_prints_a_legend_for_every_character_it_draws(bidirectional, capsys):
    argv = ["draw", "--heads", "3", "--seq", "512", "--block", "32", "--local-blocks", "2"]
    argv += ["--vert-stride", "3"] + (["--bidirectional"] if bidirectional else [])
    code, out, _ = _run(argv, capsys)
    assert code == 0
    legend = out.split("\nhead ")[0]
    pictures = _pictures(out)
    assert sorted(pictures) == [0, 1, 2]
    drawn = {c for rows in pictures.values() for row in rows for c in row}
    # 16 blocks, a local window of 2 and a stride of 3: some kept, some skipped; when causal, the
    # blocks after the diagonal are left blank (each row stops at the diagonal).
    assert drawn == {"#", "."}
    widths = [len(row) for rows in pictures.values() for row in rows]
    assert widths == ([16] * 48 if bidirectional else list(range(1, 17)) * 3)
    assert "32 tokens each" in legend
    assert re.search(r"^  #\s+attended$", legend, re.M), legend
    assert re.search(r"^  \.\s+skipped by the pattern$", legend, re.M), legend
    assert (re.search(r"^  \(blank\)\s+hidden by the causal mask", legend, re.M) is None) == (
        bidirectional
    ), legend


@pytest.mark.parametrize("show, expected", [([], [0, 1, 2, 3]), (["--show-heads", "2"], [0, 1])])
def test_draw_shows_the_requested_heads(show, expected, capsys):
    code, out, _ = _run(["draw", "--heads", "6", "--seq", "256", *show], capsys)
    assert code == 0
    assert sorted(_pictures(out)) == expected


def test_demo_runs_on_a_tiny_stack(capsys):
    code, out, err = _run(["demo", "--layers", "2", "--dense-layers", "1", "--seq", "64"], capsys)
    assert code == 0, out + err
    assert "2 layers, the first 1 dense" in out and "seq 64" in out
    assert re.search(r"^\s+1\s+S2\s", out, re.M), out
    assert "-> OK" in out
    assert "  #        attended" in out


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the re-run under the interpreter is CPU-only"
)
def test_demo_reruns_its_own_arguments_under_the_interpreter(monkeypatch):
    """Without a GPU, ``demo`` execs itself with TRITON_INTERPRET=1, and with the arguments given
    to ``main`` (not the calling process's ``sys.argv``)."""

    class Exec(Exception):
        pass

    def fake_execv(path, args):
        raise Exec(path, args)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cli.os, "execv", fake_execv)
    argv = ["demo", "--layers", "3", "--seq", "64"]
    with pytest.raises(Exec) as info:
        cli.main(argv)
    assert info.value.args == (sys.executable, [sys.executable, "-m", "s2attn", *argv])
    assert os.environ["TRITON_INTERPRET"] == "1"


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize("absent", [["transformers"], ["tqdm"], ["transformers", "tqdm"]])
def test_model_commands_name_the_extra_they_need(command, absent, tmp_path, monkeypatch, capsys):
    """Without transformers or tqdm, `train` and `eval` stop before any work (no output
    directory made) with one line naming each missing package and the extra that brings it."""
    for name in absent:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    out = tmp_path / "run"
    argv = ["train", "--out", str(out)] if command == "train" else ["eval", str(out)]
    code, stdout, err = _run(argv, capsys)
    assert code == 1, (stdout, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"s2attn {command}: error: `s2attn {command}` needs "), err
    for name in absent:
        assert f"{name} (not installed)" in err, err
    assert err.rstrip().endswith("pip install 's2attn[models]'"), err
    assert not out.exists()


def test_the_models_extra_holds_what_the_commands_check():
    import tomllib

    from s2attn.training import dependencies

    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"][dependencies.INSTALL.split("[")[1][:-2]]
    names = {re.match(r"[\w-]+", requirement).group() for requirement in extra}
    assert names == {name for name, _ in dependencies.REQUIRED + dependencies.OPTIONAL}
    for name, major in dependencies.REQUIRED:
        if major is not None:
            assert f"{name}>={major}" in extra


def test_draw_into_a_pipe_closed_early_ends_quietly():
    """`s2attn draw | head`: the reader goes away while the command still writes; the command
    ends without a BrokenPipeError traceback (or an "Exception ignored" line at exit)."""
    # 32 heads of 64 rows: far more than a pipe's buffer, so the writes outlast the reader.
    argv = ["draw", "--heads", "32", "--show-heads", "32", "--seq", "4096"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "s2attn", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    first = proc.stdout.readline()
    proc.stdout.close()
    try:
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert first.startswith(b"BlockPattern"), first
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert code == cli._BROKEN_PIPE
