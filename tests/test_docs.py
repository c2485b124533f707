"""The docs stay a guide: README.md stays short, every measurement kept in git is one that
docs/results.md cites, and every relative link in README.md and docs/*.md reaches its file (and
its heading, when it names one)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300

# [text](target) and ![alt](target); the target ends at whitespace or the closing bracket.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.MULTILINE)}


def broken_links(path: Path) -> list[str]:
    """The relative links of a markdown file whose file, or heading, does not exist."""
    broken = []
    for target in _LINK.findall(_FENCE.sub("", path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    return broken


def uncited_results(tracked: list[str], results_page: str) -> list[str]:
    """Files under docs/results/ that docs/results.md does not link to."""
    cited = {target.partition("#")[0] for target in _LINK.findall(results_page)}
    return [
        name
        for name in tracked
        if name.startswith("docs/results/") and name.removeprefix("docs/") not in cited
    ]


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail to docs/"
    )


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.name)
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def _tracked(folder: str) -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    listing = subprocess.run(
        ["git", "ls-files", folder], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return listing.stdout.split()


def test_every_tracked_result_is_cited():
    tracked = _tracked("docs/results")
    assert tracked, "docs/results/ holds no tracked measurements"
    uncited = uncited_results(tracked, (ROOT / "docs" / "results.md").read_text())
    assert uncited == [], f"tracked but not cited by docs/results.md: {uncited}"


def test_benchmark_output_is_not_tracked():
    tracked = _tracked("benchmarks/results")
    assert tracked == [], "benchmarks/results/ is scratch: copy a cited run to docs/results/"


def test_checks_find_what_they_look_for(tmp_path):
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading-with-code) [web](https://example.com)\n"
        "[gone](missing.md) [bad anchor](there.md#nowhere) ![img](missing.png)\n"
        "```bash\n[inside a fence](not-a-link.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md", "there.md#nowhere", "missing.png"]
    tracked = ["docs/results/a.md", "docs/results/b.png", "docs/results.md", "README.md"]
    assert uncited_results(tracked, "[a](results/a.md) and b.png in prose") == [
        "docs/results/b.png"
    ]
