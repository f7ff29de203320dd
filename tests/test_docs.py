"""The project's own method document, the citations of it, and the README's user-facing promises."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from latim_jax import tasks
from latim_jax.cli import main
from latim_jax.cli.args import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from latim_jax.io.loading import ASSETS, SHIPPED

ROOT = Path(__file__).resolve().parents[1]
METHOD = ROOT / "docs" / "method.md"
GUIDE = ROOT / "docs" / "guide.md"
TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".toml", ".json", ".txt", ".in"}
PROJECT_DIRS = (
    "latim_jax",
    "kernels",
    "convert",
    "tests",
    "scripts",
    "notebooks",
    "benchmarks",
    "docs",
    "configs",
)
# files the lead edits in the same round: their citations move to docs/method.md when merging
# (remove each entry once its file cites docs/method.md)
PENDING: set[str] = set()


def text_files():
    """(relative path, text) of the project's own text files (not virtual environments or outputs)."""
    paths = [p for p in ROOT.iterdir() if p.is_file()]
    paths += [p for d in PROJECT_DIRS for p in (ROOT / d).rglob("*") if p.is_file()]
    for path in paths:
        rel = path.relative_to(ROOT)
        if path.suffix in TEXT_SUFFIXES and "assets" not in rel.parts and "__pycache__" not in rel.parts:
            yield rel.as_posix(), path.read_text(errors="replace")


def method_sections() -> dict[int, str]:
    return {int(n): title for n, title in re.findall(r"^## (\d+)\. (.+)$", METHOD.read_text(), re.M)}


def test_method_document_has_its_numbered_sections():
    """Sections numbered 1..n without gaps: the code and the docs cite them by number."""
    sections = method_sections()
    assert sorted(sections) == list(range(1, len(sections) + 1)) and len(sections) >= 10


def test_every_public_name_and_command_is_documented():
    """Each name of ``latim_jax.__all__`` appears in the README or the guide, and each `latim-jax`
    command in the guide: a new capability without a user-facing word fails here."""
    import latim_jax
    from latim_jax.cli.main import build_parser

    docs = (ROOT / "README.md").read_text() + GUIDE.read_text()
    missing = [name for name in latim_jax.__all__ if not name.startswith("_") and name not in docs]
    assert missing == [], missing
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    guide = GUIDE.read_text()
    undocumented = [c for c in sub.choices if f"latim-jax {c}" not in guide]
    assert undocumented == [], undocumented


def test_readme_headline_numbers_are_the_result_files():
    """The README's alignment and copy numbers are those of the evaluation files they cite (a rerun
    that changes a result must change the README too)."""
    import json

    readme = (ROOT / "README.md").read_text()
    results = ROOT / "benchmarks" / "results" / "tasks"
    align = json.loads((results / "align_eval_mamba2.json").read_text())
    best = {name: min(row["layers"]) for name, row in align["rows"].items()}
    hidden = [best[f"hidden attention ({a})"] for a in ("abs", "minmax")]
    want = (
        f"LaTIM logit {best['LaTIM logit (exact)']:.3f}, l2 {best['LaTIM l2 (exact)']:.3f} vs hidden "
        f"attention {hidden[0]:.3f}-{hidden[1]:.3f} (Mamba-2); random {align['random']:.3f}"
    )
    assert want in readme, want
    copy = json.loads((results / "copy_eval_mamba2.json").read_text())
    assert f"Mamba-2 LaTIM l2 {copy['rows']['LaTIM l2 (exact)']['best']['auc']:.3f}" in readme
    hybrid = json.loads((results / "hybrid_needle.json").read_text())
    single = [e for e in hybrid["results"] if e["setting"] == "single"]
    full, removed = (
        " / ".join(f"{e['models'][v]['accuracy']:.3f}" for e in single) for v in ("full", "attention removed")
    )
    push = [[layer["gold_logit"] for layer in e["models"]["full"]["layers"][:2]] for e in single]
    share = [f"{100 * a / (s + a):.0f}%" for s, a in push]
    assert f"({share[0]} of the push at 512, {share[-1]} at 8192)" in readme, share
    assert f"one-needle accuracy {full}, without attention {removed}" in readme


MISSING_DOC = "latim" + "-math.md"  # split so that this file does not cite it


def test_no_file_cites_the_missing_latim_math_document():
    citing = sorted(rel for rel, text in text_files() if MISSING_DOC in text and rel not in PENDING)
    assert citing == []


def test_every_method_md_citation_names_an_existing_section():
    sections = method_sections()
    cited = []
    for rel, text in text_files():
        for match in re.finditer(r"docs/method\.md,? sections? ([\d ,\-and]+)", text):
            numbers = [int(n) for n in re.findall(r"\d+", match.group(1))]
            cited += [(rel, n) for n in numbers]
    assert len(cited) >= 5
    assert [c for c in cited if c[1] not in sections] == []


def test_guide_documents_masks_vocabularies_and_exit_codes():
    guide = GUIDE.read_text()
    assert f"**{EXIT_OK}** success" in guide and f"**{EXIT_FAILED}** the check" in guide
    assert f"**{EXIT_USAGE}** usage or input error" in guide
    readme = (ROOT / "README.md").read_text()
    assert "docs/method.md" in readme and "docs/guide.md" in readme and "docs/architecture.md" in readme


@pytest.mark.parametrize("name", SHIPPED)
def test_guide_vocabulary_table_matches_the_shipped_models(name):
    """The vocabulary column lists id ranges that tile the whole vocabulary ("1-31 = `t1` .. `t31`",
    "3-67 = source words (`der`, ..., `·`)"); each range's first and last quoted word are the words at
    those ids, and every quoted word lies inside its range."""
    import json

    task = json.loads((ASSETS / name / "task.json").read_text())
    words = tasks.vocabulary(task)
    row = next(line for line in GUIDE.read_text().splitlines() if f"`{name}`" in line and "|" in line)
    cell = row.strip().strip("|").split("|")[2]
    parts = re.split(r"(?:^|,)\s*(\d+)(?:-(\d+))? = ", cell)[1:]
    triples = [parts[k : k + 3] for k in range(0, len(parts), 3)]
    ranges = [(int(a), int(b or a), re.findall(r"`([^`]+)`", text)) for a, b, text in triples]
    assert [r[0] for r in ranges] == [0] + [r[1] + 1 for r in ranges[:-1]], (ranges, row)
    assert ranges[-1][1] == len(words) - 1, (ranges[-1], len(words))
    for a, b, quoted in ranges:
        assert quoted[0] == words[a] and quoted[-1] == words[b], (a, b, quoted, words[a], words[b])
        assert set(quoted) <= set(words[a : b + 1]), (a, b, quoted)


def test_readme_first_command_and_vocabulary_examples_run(tmp_path, monkeypatch, capsys):
    readme = (ROOT / "README.md").read_text()
    guide = GUIDE.read_text()
    first = re.search(r"```bash\n(.*?)\n```", readme, re.S).group(1)
    command = first.split("&& latim-jax ", 1)[1]
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(command)) == 0
    assert {"map.npz", "map.png", "map.html"} <= {p.name for p in tmp_path.iterdir()}
    example = re.search(r"^latim-jax (generate --model mqar-mamba2 .*?)\s+# -> \.\.\. (\S+)$", guide, re.M)
    capsys.readouterr()
    assert main(shlex.split(example.group(1))) == 0
    assert capsys.readouterr().out.split()[-1] == example.group(2)


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path, monkeypatch, capsys):
    """Every `latim-jax ...` line of the README's command blocks runs as written (in an empty
    directory; the dataset line gets a prompts.jsonl of two prompts, the one file it needs)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)[1:]  # the set-up commands: above
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    commands = [line[len("latim-jax ") :] for line in lines if line.startswith("latim-jax ")]
    assert len(commands) >= 4, commands
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text(
        '{"id": "a", "text": "t3 t9 t4 <sep> t3 t9"}\n{"id": "b", "tokens": [5, 6, 0, 5]}\n'
    )
    for command in commands:
        assert main(shlex.split(command)) == 0, (command, capsys.readouterr().err[-2000:])


def documents():
    """(relative path, text) of the README, BENCHMARKS.md and every Markdown file under docs/."""
    paths = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in paths]


def test_every_document_link_resolves():
    """Every relative Markdown link of the README, BENCHMARKS.md and docs/ names an existing file (and,
    with #anchor, an existing heading of it); links to the web are left alone."""
    checked = []
    for rel, text in documents():
        base = (ROOT / rel).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (base / path).resolve() if path else ROOT / rel
            assert dest.exists(), (rel, target)
            if anchor:
                headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
                slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in headings}
                assert anchor in slugs, (rel, target)
            checked.append(target)
    assert len(checked) >= 20


def test_readme_python_runs_as_written(tmp_path, monkeypatch):
    """Every python block of the README runs, top to bottom, in one namespace (its own asserts
    included: conservation, the saved file read back)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)\n```", readme, re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert (tmp_path / "scores.npz").is_file()


def test_readme_is_short():
    """The README is the entry point (set-up, a tour, the headline results, links); the guide, the
    experiments and the notes live in docs/ and benchmarks/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
