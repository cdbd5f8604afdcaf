"""Every Python example of the README and of the documentation site's pages runs as written.

Each ```python block runs on its own, in a fresh namespace, in a temporary directory. A block
that cannot run here says why in an HTML comment on the line before it,
``<!-- not-run: REASON -->`` (another library's API, torchrun's processes...): it is reported
as skipped with that reason, and a test keeps such blocks few. A guide that builds one program
step by step marks each later block ``<!-- continues -->``: it runs after the blocks before it, in
their namespace. ``<!-- given: NAME -->`` before a first block puts the files ``GIVEN[NAME]`` makes
into its directory (the model folders a guide starts from).
"""

import re
import shutil
import textwrap
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- (?P<directive>not-run|given|continues)(?:: (?P<arg>.*?))? -->\n)?"
                   r"(?P<indent>[ \t]*)```python\n(?P<code>.*?)(?P=indent)```", re.S)
README_SIZE_LIMIT = 8 * 1024


def _llama_int4(directory: Path) -> None:
    """``llama-hf`` (a random-init 2-layer Llama saved by transformers, with a tokenizer) and
    ``llama-int4`` (onnxruntime-genai's builder on it: ``-p int4 -e cpu``)."""
    from genai_models import genai_model

    built = genai_model("llama", "int4", directory / ".build")
    shutil.copytree(built.parent / "hf", directory / "llama-hf")
    shutil.copytree(built, directory / "llama-int4")


GIVEN = {"llama-int4": _llama_int4}


def _blocks() -> list:
    found: list[list] = []  # [where, code, not-run reason, given]
    for path in DOCUMENTS:
        for index, match in enumerate(BLOCK.finditer(path.read_text())):
            where = f"{path.relative_to(ROOT)}[python block {index}]"
            code = textwrap.dedent(match["indent"] + match["code"])
            directive, arg = match["directive"], match["arg"]
            if directive == "continues":
                assert found and found[-1][0].startswith(f"{path.relative_to(ROOT)}["), f"{where} continues nothing"
                found[-1][0] = f"{found[-1][0].rpartition(' ')[0]} {found[-1][0].rpartition(' ')[2][:-1]}+{index}]"
                found[-1][1] += f"\n# --- {where}\n{code}"
                continue
            assert directive != "given" or arg in GIVEN, f"{where}: no GIVEN[{arg!r}]"
            found.append([where, code, arg if directive == "not-run" else None, arg if directive == "given" else None])
    return [pytest.param(*block, id=block[0]) for block in found]


BLOCKS = _blocks()


@pytest.mark.parametrize("where,code,not_run,given", BLOCKS)
def test_documented_example_runs(where, code, not_run, given, tmp_path, monkeypatch):
    if not_run:
        pytest.skip(f"{where}: {not_run}")
    if given:
        GIVEN[given](tmp_path)
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
