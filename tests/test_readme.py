"""Every Python example of the README and of the documentation site's pages runs as written.

Each ```python block runs on its own, in a fresh namespace, in a temporary directory. A block
that cannot run here says why in an HTML comment on the line before it,
``<!-- not-run: REASON -->`` (another library's API, torchrun's processes...): it is reported
as skipped with that reason, and a test keeps such blocks few.
"""

import re
import textwrap
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- not-run: (?P<reason>.*?) -->\n)?(?P<indent>[ \t]*)```python\n(?P<code>.*?)(?P=indent)```",
                   re.S)
README_SIZE_LIMIT = 8 * 1024


def _blocks() -> list:
    found = []
    for path in DOCUMENTS:
        for index, match in enumerate(BLOCK.finditer(path.read_text())):
            where = f"{path.relative_to(ROOT)}[python block {index}]"
            code = textwrap.dedent(match["indent"] + match["code"])
            found.append(pytest.param(where, code, match["reason"], id=where))
    return found


BLOCKS = _blocks()


@pytest.mark.parametrize("where,code,not_run", BLOCKS)
def test_documented_example_runs(where, code, not_run, tmp_path, monkeypatch):
    if not_run:
        pytest.skip(f"{where}: {not_run}")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"doc_example_{abs(hash(where))}"}
    exec(compile(code, where, "exec"), namespace)


def test_most_documented_examples_run():
    skipped = [b.values[0] for b in BLOCKS if b.values[2]]
    readme = [b for b in BLOCKS if b.values[0].startswith("README.md")]
    assert len(readme) >= 2 and not any(b.values[2] for b in readme)  # every README block runs
    assert len(skipped) <= 8 and len(BLOCKS) >= 3 * len(skipped), skipped


def test_the_readme_is_short_and_links_only_to_what_exists():
    """No link to a repository or index that does not exist: the README's links are the checkout's
    own files (and anchors in them), and the package metadata names no project URL."""
    text = README.read_text()
    assert len(text.encode()) < README_SIZE_LIMIT
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links and not [link for link in links if "://" in link], links
    for link in links:
        path, _, anchor = link.partition("#")
        assert (ROOT / path).is_file(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            assert anchor in {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}, link
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "urls" not in project
    for path in [README, *DOCUMENTS]:
        assert "github.com/onnx-training-ops" not in path.read_text(), path
