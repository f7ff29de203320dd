"""User errors on the command line: each is one ``error:`` line on stderr naming the problem, exit code
2 (usage or input) or 1 (a check that failed), no traceback, and refused before any long computation.
Relative paths throughout (tests run in tmp_path)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from latim_jax import cli
from latim_jax.cli import main
from latim_jax.cli.args import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from latim_jax.convert import save_checkpoint
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params

CFG = MambaConfig(version=1, d_model=8, n_layers=1, vocab_size=12, d_state=2, d_conv=2)


@pytest.fixture
def here(tmp_path, monkeypatch):
    """tmp_path as the current directory, holding a tiny checkpoint ./ck."""
    save_checkpoint(tmp_path / "ck", CFG, init_params(CFG, 0))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def no_compute(monkeypatch):
    """Fail the test if the command reaches the attribution or generation computation."""
    import latim_jax.latim.attribution
    import latim_jax.model.generate

    def boom(*a, **k):
        raise AssertionError("computation started before the input was checked")

    monkeypatch.setattr(latim_jax.latim.attribution, "attribute", boom)
    monkeypatch.setattr(latim_jax.model.generate, "generate", boom)


def run(argv, capsys):
    """(exit code, stderr) of ``latim-jax argv``; checks stderr is one 'error:' line when rc != 0."""
    rc = main(argv)
    err = capsys.readouterr().err
    if rc != EXIT_OK:
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return rc, err


def test_exit_codes_are_documented_in_help(capsys):
    assert (EXIT_OK, EXIT_FAILED, EXIT_USAGE) == (0, 1, 2)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "exit codes:" in out and "0  success" in out and "1  the check" in out and "2  usage" in out


def test_choices_are_the_api_choices(capsys):
    """The CLI takes its choices from the library (no repeated list): every API method, mode and
    precision parses, and anything else is an invalid choice naming the flag."""
    from latim_jax.latim.kinds import MODES
    from latim_jax.latim.scores import METHODS, PRECISIONS

    parser = cli.build_parser()
    for method in METHODS:
        for mode in MODES:
            for precision in PRECISIONS:
                args = ["attribute", "--method", method, "--mode", mode, "--precision", precision]
                parsed = parser.parse_args(args)
                assert (parsed.method, parsed.mode, parsed.precision) == (method, mode, precision)
    for argv, name in [
        (["attribute", "--method", "nope"], "--method"),
        (["attribute", "--mode", "approx"], "--mode"),
        (["evaluate", "mqar", "--gold", "answer"], "--gold"),
        (["convert", "a", "b", "--dtype", "int8"], "--dtype"),
    ]:
        rc, err = run(argv, capsys)
        assert rc == EXIT_USAGE and name in err and "invalid choice" in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["attribute", "--model", "ck", "--out", "missing/s.npz"], ["--out", "does not exist"]),
        (["attribute", "--model", "ck", "--out", "ck"], ["--out", "is a directory"]),
        (["attribute", "--model", "ck", "--out", "old.npz"], ["--out", "exists", "--force"]),
        (["attribute", "--model", "ck", "--out", "x.html", "--html", "x.html"], ["same file"]),
        (["attribute", "--model", "ck", "--plot", "map.bmp"], ["--plot", ".bmp", ".png", ".svg"]),
        (["attribute", "--model", "ck", "--plot", "map"], ["--plot", "no extension"]),
        (["attribute", "--model", "ck", "--text", "a", "--tokens", "1"], ["--text", "--tokens"]),
        (["attribute", "--model", "ck", "--tokens", ""], ["prompt is empty"]),
        (["attribute", "--model", "ck", "--tokens", "1 x"], ["--tokens", "integers"]),
        (["attribute", "--model", "copy-mamba1", "--tokens", "3 -1 4"], ["--tokens", "[0, 32)", "[-1]"]),
        (["attribute", "--model", "copy-mamba1", "--tokens", "3 99999999999999999999"], ["[0, 32)"]),
        (["attribute", "--model", "ck", "--text-file", "nope.txt"], ["--text-file nope.txt", "cannot read"]),
        (["attribute", "--model", "ck", "--text", "a", "--tokens-file", "old.npz"], ["pass one of"]),
        (["attribute", "--model", "ck/latim_config.json", "--tokens", "1"], ["a file", "directory"]),
        (["attribute", "--model", "nowhere", "--tokens", "1"], ["nowhere", "shipped models"]),
        (["attribute", "--model", "needle-hybrid-gdn"], ["'needle' task has no default prompt", "--text"]),
        (["attribute", "--model", "ck", "--seed", "-1"], ["--seed", ">= 0"]),
        (["generate", "--model", "ck", "--tokens", "1", "--max-new-tokens", "-1"], ["--max-new-tokens"]),
        (["generate", "--model", "ck", "--tokens", "1", "--temperature", "nan"], ["--temperature", "nan"]),
        (["generate", "--model", "ck", "--tokens", "1", "--temperature", "-1"], ["--temperature"]),
        (["generate", "--model", "ck", "--tokens", " "], ["prompt is empty"]),
        (["generate", "--model", "ck"], ["no task", "--tokens"]),
        (["evaluate", "copy", "--n", "0"], ["--n", "positive"]),
        (["evaluate", "copy", "--batch-size", "0"], ["--batch-size", "positive"]),
        (["evaluate", "copy", "--model", "copy-mamba1", "--version", "2"], ["--version", "--model"]),
        (["evaluate", "copy", "--gold", "value"], ["--gold value", "mqar"]),
        (["evaluate", "copy", "--model", "ck"], ["trained on no task", "'copy'"]),
        (["evaluate", "copy", "--model", "mqar-mamba2"], ["mqar", "'copy'"]),
        (["evaluate", "mqar", "--out", "missing/r.json"], ["--out", "does not exist"]),
        (["check", "--model", "ck", "--length", "0"], ["--length", "positive"]),
        (["check", "--model", "ck", "--json", "ck"], ["--json", "is a directory"]),
        (["convert", "ck", "ck", "--overwrite"], ["is the source"]),
    ],
)
def test_user_errors_are_one_line_with_exit_code_2(here, capsys, no_compute, argv, words):
    (here / "old.npz").write_bytes(b"keep")
    rc, err = run(argv, capsys)
    assert rc == EXIT_USAGE
    for word in words:
        assert word in err, (word, err)
    assert (here / "old.npz").read_bytes() == b"keep"
    assert sorted(p.name for p in here.iterdir()) == ["ck", "old.npz"]  # nothing written, no temp files


@pytest.mark.parametrize(
    "argv, words",
    [
        (["attribute", "--model", "ck", "--tokens", "1 99"], ["must lie in"]),
        (["attribute", "--model", "ck", "--tokens", "1", "--layers", "7"], ["layer"]),
        (["attribute", "--model", "ck", "--tokens", "1 2", "--rows", "5"], ["rows"]),
    ],
)
def test_api_input_errors_become_one_line_with_exit_code_2(here, capsys, argv, words):
    rc, err = run(argv + ["--out", "s.npz"], capsys)
    assert rc == EXIT_USAGE and all(w in err for w in words), err
    assert not (here / "s.npz").exists()


def test_task_mismatch_is_one_short_line(here, capsys):
    rc, err = run(["evaluate", "copy", "--model", "mqar-mamba1"], capsys)
    assert rc == EXIT_USAGE and len(err) < 200 and "history" not in err and "loss" not in err


def test_shipped_name_typo_suggests_at_once_without_the_hub(here, capsys, monkeypatch):
    import huggingface_hub

    def no_hub(*a, **k):
        raise AssertionError("a shipped-name typo must not reach the hub")

    for name in ("snapshot_download", "model_info", "list_repo_files"):
        monkeypatch.setattr(huggingface_hub, name, no_hub)
    for typo, suggestion in [("copy-mamba3", "copy-mamba2"), ("copy_mamba2", "copy-mamba2"), ("mqar", "")]:
        rc, err = run(["attribute", "--model", typo, "--tokens", "1"], capsys)
        assert rc == EXIT_USAGE
        assert f"'{suggestion}'" in err if suggestion else "shipped models: copy-mamba1" in err
        assert "owner/name" in err


def test_mistyped_local_path_does_not_reach_the_hub(here, capsys, monkeypatch):
    import huggingface_hub

    def no_hub(*a, **k):
        raise AssertionError("a path under a local directory must not reach the hub")

    for name in ("snapshot_download", "model_info", "list_repo_files"):
        monkeypatch.setattr(huggingface_hub, name, no_hub)
    rc, err = run(["info", "ck/nope"], capsys)
    assert rc == EXIT_USAGE and "ck/nope" in err and "no such checkpoint directory" in err


def test_hub_id_fails_fast_and_clearly_offline(here, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, err = run(["info", "latim-jax-tests/no-such-model"], capsys)
    assert rc == EXIT_USAGE
    assert "latim-jax-tests/no-such-model" in err and "offline" in err and "local" in err


def test_check_verdict_states_the_tolerance_and_fails_on_nan():
    from latim_jax.cli.check import verdict

    report = {"max_logit_error_relative": 2e-7, "hidden_error_relative": [1e-7, 3e-7]}
    ok = verdict(report, 1e-4)
    assert ok["passed"] and ok["summary"].startswith("PASS") and "1.0e-04" in ok["summary"]
    high = verdict({**report, "hidden_error_relative": [1e-7, 5e-3]}, 1e-4)
    assert not high["passed"] and "layer 1" in high["summary"] and high["summary"].startswith("FAIL")
    nan = verdict({**report, "max_logit_error_relative": float("nan")}, 1e-4)
    assert not nan["passed"] and "FAIL" in nan["summary"] and "NaN" in nan["summary"]


@pytest.mark.torch
def test_check_cli_passes_and_fails(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    import torch
    from conftest import build_hf

    model = build_hf(2, vocab=16)
    model.save_pretrained(tmp_path / "good")
    with torch.no_grad():
        model.backbone.layers[0].mixer.out_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    monkeypatch.chdir(tmp_path)
    assert main(["check", "--model", "good", "--length", "5", "--json", "r.json"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "PASS" in out and "tolerance 1.0e-04" in out
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is True
    rc, err = run(["check", "--model", "nan", "--length", "5"], capsys)
    assert rc == EXIT_FAILED and "FAIL" in err
    # a tolerance below the float rounding fails too, with exit code 1
    assert main(["check", "--model", "good", "--length", "5", "--tolerance", "1e-30"]) == EXIT_FAILED
    assert np.isfinite(json.loads((tmp_path / "r.json").read_text())["max_logit_error"])


def test_an_unreadable_tokenizer_is_named_and_ids_still_work(here, capsys):
    """A corrupt tokenizer.json: --tokens still runs (labels show ids, with a warning naming the file),
    --text is a one-line error naming it, info reports it."""
    (here / "ck" / "tokenizer.json").write_text("{not json")
    assert main(["attribute", "--model", "ck", "--tokens", "1 2 3", "--out", "s.npz"]) == EXIT_OK
    err = capsys.readouterr().err
    assert "warning: " in err and "tokenizer.json: not a readable tokenizer" in err and "Traceback" not in err
    rc, err = run(["attribute", "--model", "ck", "--text", "a b", "--out", "t.npz"], capsys)
    assert rc == EXIT_USAGE and "tokenizer.json: not a readable tokenizer" in err
    assert main(["info", "ck"]) == EXIT_OK
    assert "not a readable tokenizer" in capsys.readouterr().out


def test_a_prompt_too_large_names_this_commands_options(here, capsys, monkeypatch):
    """The memory refusal speaks the CLI's language (--rows -1; what only the Python API has, said
    so) and counts the prompt's tokens, not the length bucket it was padded to."""
    from latim_jax.latim import memory

    monkeypatch.setattr(memory, "available", lambda: int(0.8e6 * memory.AUTO_MARGIN))  # 0.6 < 0.8 < 1 MB
    tokens = " ".join(["1"] * 200)  # bucketed to a longer length internally
    rc, err = run(["attribute", "--model", "ck", "--tokens", tokens, "--out", "s.npz"], capsys)
    assert rc == EXIT_USAGE and "of 200 tokens" in err and "--rows -1" in err, err
    assert "top_k=32" not in err and "stream_to=DIR" not in err and not (here / "s.npz").exists()


def test_prompt_from_a_file_or_stdin(here, capsys, monkeypatch):
    """--tokens-file / --text-file ('-' = stdin) take prompts too long for an argument list."""
    import io

    (here / "ids.txt").write_text("1 2\n3 4\n")
    assert main(["attribute", "--model", "ck", "--tokens-file", "ids.txt", "--out", "a.npz"]) == EXIT_OK
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2 3 4"))
    assert main(["attribute", "--model", "ck", "--tokens-file", "-", "--out", "b.npz"]) == EXIT_OK
    a, b = (np.load(here / f, allow_pickle=False) for f in ("a.npz", "b.npz"))
    assert a["tokens"].tolist() == [[1, 2, 3, 4]] and np.array_equal(a["scores"], b["scores"])


def test_a_closed_pipe_is_not_an_error(here, capsys, monkeypatch):
    """`latim-jax info | head -1`: the reader leaving is not reported as an error."""

    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", Closed())
    assert main(["info", "ck"]) == EXIT_OK
    assert capsys.readouterr().err == ""


def test_dataset_line_the_tokenizer_rejects_is_a_skipped_bad_line(here, capsys):
    (here / "p.txt").write_text("t3 t4 zzz\nt3 t5\n")
    argv = ["attribute-dataset", "--model", "copy-mamba1", "--input", "p.txt", "--out", "r", "--quiet"]
    assert main(argv + ["--on-bad-line", "skip"]) == EXIT_OK
    captured = capsys.readouterr()
    assert "skipped p.txt:1: unknown word(s) ['zzz']" in captured.err and "Traceback" not in captured.err
    assert "1 prompts attributed" in captured.out


def test_write_errors_name_the_users_path(tmp_path):
    from latim_jax.io.atomic import write_bytes_atomic

    target = tmp_path / "d"
    target.mkdir()
    (target / "x").write_text("keep")
    with pytest.raises(OSError, match=f"cannot write {target}") as err:
        write_bytes_atomic(target, b"data")
    assert ".tmp-" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temporary file left


def test_help_names_every_shipped_model_and_every_default(capsys):
    """--model's help lists every shipped model; attribute-dataset's options each have a help text
    with the default; the top-level help lists every command in plain text; the default method is
    the same for attribute, attribute-dataset and the API."""
    import inspect

    import latim_jax
    from latim_jax.io.loading import SHIPPED

    assert main(["attribute", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert all(name in out.replace("- ", "-") for name in SHIPPED), out
    assert main(["attribute-dataset", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in [
        ("--method", "alti"),
        ("--mode", "exact"),
        ("--on-bad-line", "fail"),
        ("--impl", "auto"),
    ]:
        assert f"(default {default})" in out.split(flag + " {")[1].split(" --")[0] or "default)" in out, flag
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "attribute-dataset" in out.split("positional arguments")[0] and "``" not in out
    parser = cli.build_parser()
    api = inspect.signature(latim_jax.attribute).parameters["method"].default
    assert parser.parse_args(["attribute"]).method == api
    assert parser.parse_args(["attribute-dataset", "--input", "x", "--out", "y"]).method == api


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--rows", "2 2"], ["--rows", "[2] more than once"]),
        (["--out", "out.txt"], ["--out 'out.txt' must end in .npz"]),
        (["--html", "o.png"], ["--html 'o.png' must end in .html or .htm"]),
    ],
)
def test_attribute_outputs_and_rows_are_checked(here, capsys, no_compute, argv, words):
    rc, err = run(["attribute", "--model", "ck", "--tokens", "1 2 3"] + argv, capsys)
    assert rc == EXIT_USAGE and all(w in err for w in words), err


def test_attribute_prints_the_default_prompt_and_the_mode_only_where_it_applies(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert (
        main(["attribute", "--model", "copy-mamba1", "--method", "hidden_attention", "--rows", "last"]) == 0
    )
    out = capsys.readouterr().out
    assert "prompt (the task's default, --seed 0): t" in out and "<sep>" in out
    assert "hidden_attention scores, shape (1, 2, 1," in out and "mode" not in out.split("wrote")[1]


def test_info_warns_when_the_tokenizer_does_not_fit_the_model(here, capsys):
    from latim_jax.tasks.vocab import word_tokenizer

    words = [f"w{i}" for i in range(20)]  # the model has 12 ids
    (here / "ck" / "tokenizer.json").write_text(word_tokenizer(words).to_str())
    assert main(["info", "ck"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "warning: the tokenizer has 20 tokens but the model only 12 ids" in out
    rc, err = run(["attribute", "--model", "ck", "--text", "w3 w15", "--out", "s.npz"], capsys)
    assert rc == EXIT_USAGE and "[0, 12)" in err


def test_rollout_from_the_command_line(here, capsys):
    import latim_jax

    argv = ["attribute", "--model", "ck", "--tokens", "1 2 3 4", "--method", "alti", "--rollout"]
    assert main(argv + ["--out", "r.npz", "--html", "r.html"]) == EXIT_OK
    saved = latim_jax.Attribution.load("r.npz")
    np.testing.assert_allclose(saved.extra["rollout"], saved.rollout(), rtol=1e-6)
    assert "rollout of layers 0-0" in (here / "r.html").read_text()
    rc, err = run(argv[:-1] + ["--rollout", "--rows", "-1", "--out", "s.npz"], capsys)
    assert rc == EXIT_USAGE and "--rollout composes every layer" in err
    rc, err = run(["attribute", "--model", "ck", "--tokens", "1 2", "--method", "l2", "--rollout"], capsys)
    assert rc == EXIT_USAGE and "alti / hidden_attention / logit" in err


def test_a_corrupt_orbax_checkpoint_is_one_line(here):
    """Damaged data files of a converted checkpoint: one error line naming the directory, every time
    (the late reads of the failed restore once printed "RuntimeError: Event loop is closed" in about
    two runs of three, so three runs each would miss it 1 time in 27). Separate processes: the noise came
    from the process's own stderr."""
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    for name, damage in [("zeros", lambda: b"\0" * 100), ("noise", lambda: rng.bytes(100))]:
        assert main(["convert", "copy-mamba1", name]) == EXIT_OK
        for data in (here / name / "params").rglob("d/*"):
            data.write_bytes(damage())
        for _ in range(3):
            done = subprocess.run([sys.executable, "-m", "latim_jax.cli", "info", name], capture_output=True,
                                  text=True, timeout=300)  # fmt: skip
            assert done.returncode == EXIT_USAGE and "could not restore the orbax checkpoint" in done.stderr
            assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


def test_attribute_dataset_names_every_bad_line_before_any_work(here, capsys):
    """--on-bad-line fail (the default): one error line naming every bad line of the input, not only
    the first, and nothing written (the output directory is not even created)."""
    lines = ['{"id": "ok", "tokens": [1, 2]}'] + [
        json.dumps({"id": f"b{k}", "tokens": [99]}) for k in range(12)
    ]
    lines.insert(5, "{not json")
    (here / "in.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["attribute-dataset", "--model", "ck", "--input", "in.jsonl", "--out", "out", "--quiet"]
    rc, err = run(argv, capsys)
    assert rc == EXIT_USAGE and "in.jsonl: 13 bad lines" in err and "--on-bad-line skip" in err, err
    assert "line 6: not JSON" in err
    assert all(
        f"line {n}: token ids [99] outside the vocabulary [0, 12)" in err
        for n in (*range(2, 6), *range(7, 15))
    )
    assert not (here / "out").exists()


def fake_report(begin: str, errors) -> dict:
    """check.check_model's report without torch: errors per transformers hidden state."""
    return {
        "reference": "a stand-in",
        "max_logit_error": 0.0,
        "mean_logit_error": 0.0,
        "max_logit_error_relative": 0.0,
        "hidden_error_relative": list(errors),
        "hidden_states_begin": begin,
        "length": 5,
        "batch": 1,
    }


@pytest.mark.parametrize(
    "begin, labels",
    [
        ("embeddings", ["embeddings:", "after layer   0:", "after layer   1:"]),
        ("after layer 0", ["after layer   0:", "after layer   1:", "after layer   2:"]),
    ],
)
def test_check_labels_hidden_states_by_where_the_list_begins(here, capsys, monkeypatch, begin, labels):
    """check's report says whether transformers' hidden states begin with the embeddings: entry 0 is
    then the embeddings and entry i the output of layer i - 1, not "layer i"."""
    from latim_jax.cli import check

    monkeypatch.setattr(check, "check_model", lambda *a, **k: fake_report(begin, [1e-7, 2e-7, 3e-7]))
    assert main(["check", "--model", "ck", "--length", "5"]) == EXIT_OK
    out = capsys.readouterr().out
    printed = [line.split(" hidden-state")[0] for line in out.splitlines() if "hidden-state" in line]
    assert printed == labels, out


def test_check_takes_the_model_positionally_or_as_model(here, capsys, monkeypatch):
    """`check DIR` as `info DIR` does, or `check --model DIR`; both naming different models is an error,
    neither is an error naming both forms."""
    from latim_jax.cli import check

    seen = []
    monkeypatch.setattr(
        check, "check_model", lambda source, **k: seen.append(source) or fake_report("embeddings", [0.0])
    )
    assert main(["check", "ck"]) == EXIT_OK
    assert main(["check", "--model", "ck"]) == EXIT_OK
    assert main(["check", "ck", "--model", "ck"]) == EXIT_OK  # the same one twice
    assert seen == ["ck", "ck", "ck"]
    capsys.readouterr()
    rc, err = run(["check", "ck", "--model", "copy-mamba2"], capsys)
    assert rc == EXIT_USAGE and "'ck'" in err and "--model 'copy-mamba2'" in err
    rc, err = run(["check"], capsys)
    assert rc == EXIT_USAGE and "check DIR" in err and "--model" in err and seen == ["ck", "ck", "ck"]


def test_check_help_says_what_the_reference_is(capsys):
    """check's help names the reference per kind of source, not only "needs torch"."""
    assert main(["check", "--help"]) == EXIT_OK
    out = " ".join(capsys.readouterr().out.split())
    for words in ("from_pretrained", "Mamba, FalconMamba, Mamba2 or NemotronH", "refused", "exit code 2"):
        assert words in out, (words, out)


def test_tpu_check_without_libtpu_or_with_an_unknown_chip_says_what_to_do(capsys):
    """tpu-check needs a compile-only TPU device (libtpu): without it one line saying how to install it,
    exit 2; a generation it does not know is named with the known ones."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("libtpu is installed here: the refusal path does not run")
    rc, err = run(["tpu-check", "copy-mamba2", "--chip", "v5e"], capsys)
    assert rc == EXIT_USAGE and 'pip install "jax[tpu]' in err and len(err.splitlines()) == 1
    rc, err = run(["tpu-check", "copy-mamba2", "--chip", "v9"], capsys)
    assert rc == EXIT_USAGE and "v9" in err and "v5e" in err
