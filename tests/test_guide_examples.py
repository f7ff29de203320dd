"""docs/guide.md against what ships and against what the README's commands leave behind: its examples
run after the README's (an example that writes a file the README already wrote passes --force), every
file either writes in the checkout is ignored by git, the shipped models are counted right, and the
padding and --text notes say what the code does."""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import pytest

from latim_jax.io.loading import SHIPPED

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
GUIDE = (ROOT / "docs" / "guide.md").read_text()
OUTPUT_FLAGS = ("--out", "--plot", "--html", "--json", "--markdown")
NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def commands(text: str) -> list[list[str]]:
    """The argv of every `latim-jax ...` / `python scripts/...` line of the bash blocks (a trailing
    backslash continues a line; comments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)\n```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            for part in line.split("&&"):
                argv = shlex.split(part)
                if argv[:1] == ["latim-jax"] or argv[:2] == ["python", "scripts/compare_models.py"]:
                    out.append(argv)
    return out


def outputs(argv: list[str]) -> set[str]:
    """The files a command writes (relative to where it runs): its output flags' values, and the
    default --out of `latim-jax attribute`."""
    found = {argv[k + 1] for k, a in enumerate(argv[:-1]) if a in OUTPUT_FLAGS}
    if argv[1:2] == ["attribute"] and "--out" not in argv:
        found.add("attribution.npz")
    return found


def test_guide_commands_run_after_the_readmes():
    """An example that writes a file one of the README's commands wrote passes --force (else it
    stops with 'exists; pass --force'); the README's commands are the first run in a fresh checkout."""
    written = set().union(*(outputs(argv) for argv in commands(README)))
    assert {"map.npz", "copy.png", "last.npz"} <= written, written
    stopped = [
        " ".join(argv)
        for argv in commands(GUIDE)
        if argv[0] == "latim-jax"
        and argv[1] != "attribute-dataset"  # resumes the README's run of the same input (tested there)
        and outputs(argv) & written
        and "--force" not in argv
    ]
    assert not stopped, stopped


def test_every_file_the_examples_write_is_ignored_by_git():
    patterns = [
        line.strip().lstrip("/").rstrip("/")
        for line in (ROOT / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    files = set().union(*(outputs(argv) for argv in commands(README) + commands(GUIDE)))
    assert {"last.svg", "cmp.md"} <= files, files
    tracked = sorted(f for f in files if not any(fnmatch.fnmatch(f.split("/")[0], p) for p in patterns))
    assert not tracked, tracked


def test_guide_counts_the_shipped_models():
    assert len(SHIPPED) == len([p for p in (ROOT / "latim_jax" / "assets").iterdir() if p.is_dir()])
    count = NUMBERS[len(SHIPPED)].capitalize()
    assert f"{count} small models trained here ship inside the package" in GUIDE


def test_guide_says_padded_prompts_equal_the_prompt_alone_to_float_rounding():
    """The padded batch runs other shapes, so its fp32 sums round differently: equal to float rounding,
    not exactly (6.5e-6 relative has been measured)."""
    padding = GUIDE.split("## Padding and masks")[1].split("\n## ")[0]
    claims = [b for b in padding.split("\n- ") if "run alone" in b or "prompt alone" in b]
    assert claims and all("float rounding" in b for b in claims), claims
    dataset = next(b for b in GUIDE.split("\n- ") if "every prompt's scores equal the prompt alone" in b)
    assert "float rounding" in dataset


def test_guide_says_what_text_does_with_unknown_words():
    """vocab.encode maps a word outside a word-level vocabulary to its unknown token with a warning
    naming the word, and refuses it by name where the vocabulary has none; the guide says both."""
    import warnings

    from tokenizers import Tokenizer, models, pre_tokenizers

    from latim_jax.tasks import vocab

    def tokenizer(words):
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return tok

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert vocab._encode(tokenizer(["<unk>", "a", "b"]), "a zz b <unk>").ids == [1, 0, 2, 0]
    assert [type(w.message) for w in caught] == [vocab.UnknownWordsWarning]
    assert caught[0].message.words == ["zz"] and "'<unk>'" in str(caught[0].message)
    with pytest.raises(ValueError, match=r"\['zz'\]"):
        vocab._encode(tokenizer(["a", "b"]), "a zz b")  # no <unk> in the vocabulary
    prompt = next(b for b in GUIDE.split("\n- ") if b.startswith("The prompt: `--text`"))
    assert "`<unk>`" in prompt and "`note:`" in prompt and "refuses" in prompt, prompt
