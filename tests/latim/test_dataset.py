"""attribute-dataset: input parsing with line-numbered errors, batched results equal to direct attribution,
resume after SIGKILL with every prompt exactly once, and open_results (jax only)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import latim_jax
from latim_jax.convert import save_checkpoint
from latim_jax.latim.dataset import DatasetError, bucket, make_batches, open_results, read_prompts
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params

CFG = MambaConfig(
    version=2, d_model=16, n_layers=2, vocab_size=16, d_state=4, d_conv=4, head_dim=8, chunk_size=8
)
WORDS = ["<unk>", "the", "cat", "sat", "on", "mat", "a", "dog"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tok_dir / "tokenizer.json"))
    path = tmp_path_factory.mktemp("ckpt") / "m"
    save_checkpoint(path, CFG, init_params(CFG, 0), tokenizer_dir=tok_dir)
    return path


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_bad_lines_are_named_by_line_and_skipped_or_fatal(tmp_path):
    lines = [
        json.dumps({"id": "a", "tokens": [1, 2, 3]}),
        "{not json",
        "",
        json.dumps({"id": "b", "tokens": [1], "text": "the"}),
        json.dumps({"id": "a", "tokens": [4]}),  # repeated id
        json.dumps({"id": "c", "tokens": [1, 99]}),  # outside the vocabulary
        json.dumps({"id": "d", "tokens": list(range(10))}),  # too long for max_length 8
        json.dumps({"id": 7, "text": "the cat"}),
    ]
    path = write_lines(tmp_path / "p.jsonl", lines)
    with pytest.raises(
        DatasetError, match=r"p.jsonl: 7 bad lines.*--on-bad-line skip.*line 2: not JSON"
    ) as err:
        read_prompts(path, vocab_size=16, max_length=8)  # no tokenizer: line 8 is bad too
    assert [n for n, _ in err.value.bad_lines] == [2, 3, 4, 5, 6, 7, 8]  # every one, not only the first
    assert "line 8: text needs the model's tokenizer" in str(err.value)
    warnings = []
    prompts = read_prompts(
        path, vocab_size=16, max_length=8, on_bad_line="skip", warn=warnings.append, tokenize=lambda t: [1, 2]
    )
    assert [p.id for p in prompts] == ["a", "7"] and prompts[1].tokens == (1, 2) and prompts[1].line == 8
    assert [w.split(": ")[0].rsplit(":", 1)[1] for w in warnings] == ["2", "3", "4", "5", "6", "7"]
    assert "repeated id 'a' (first on line 1)" in warnings[3] and "outside the vocabulary" in warnings[4]
    with pytest.raises(DatasetError, match="needs the model's tokenizer"):
        read_prompts(write_lines(tmp_path / "t.txt", ["the cat"]), vocab_size=16)


def test_fail_reports_every_bad_line_at_once_bounded(tmp_path):
    """on_bad_line="fail" reads the whole file first: one error lists every bad line (line number and
    what is wrong), the first MAX_REPORTED of a long list and how many more; ``bad_lines`` holds all."""
    from latim_jax.latim.dataset import MAX_REPORTED

    good = json.dumps({"id": "ok", "tokens": [1]})
    lines = [good] + [json.dumps({"id": f"b{k}", "tokens": [99]}) for k in range(13)]
    with pytest.raises(DatasetError) as err:
        read_prompts(write_lines(tmp_path / "p.jsonl", lines), vocab_size=16)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'p.jsonl'}: 13 bad lines")
    assert all(f"line {n}: token ids [99] outside the vocabulary [0, 16)" in message for n in range(2, 15))
    assert "more" not in message and [n for n, _ in err.value.bad_lines] == list(range(2, 15))
    many = [good] + ["{"] * (MAX_REPORTED + 7)
    with pytest.raises(DatasetError) as err:
        read_prompts(write_lines(tmp_path / "q.jsonl", many), vocab_size=16)
    message = str(err.value)
    assert f"{MAX_REPORTED + 7} bad lines" in message and "and 7 more" in message
    assert f"line {MAX_REPORTED + 1}: not JSON" in message and f"line {MAX_REPORTED + 2}:" not in message
    assert len(err.value.bad_lines) == MAX_REPORTED + 7
    # one bad line reads as before: path:line: what
    with pytest.raises(DatasetError, match=r"r.jsonl:2: empty line \(pass --on-bad-line skip"):
        read_prompts(write_lines(tmp_path / "r.jsonl", [good, ""]), vocab_size=16)


def test_an_int_id_and_a_string_id_of_the_same_text_are_refused(tmp_path):
    """Results are keyed by the id's text (open_results(...)["7"]): an int 7 and a string "7" would be
    one key, so the second is a bad line naming both lines and both types (not "repeated id")."""
    lines = [
        json.dumps({"id": 7, "tokens": [1]}),
        json.dumps({"id": "x", "tokens": [2]}),  # int and string ids may mix when their texts differ
        json.dumps({"id": "7", "tokens": [3]}),
    ]
    path = write_lines(tmp_path / "p.jsonl", lines)
    with pytest.raises(DatasetError) as err:
        read_prompts(path, vocab_size=16)
    message = str(err.value)
    assert "p.jsonl:3:" in message and "line 1" in message, message
    assert "the string '7'" in message and "the int 7" in message and "repeated id" not in message
    skipped = []
    prompts = read_prompts(path, vocab_size=16, on_bad_line="skip", warn=skipped.append)
    assert [(p.id, p.tokens) for p in prompts] == [("7", (1,)), ("x", (2,))] and len(skipped) == 1


def test_batches_by_length_and_buckets():
    assert [bucket(n) for n in (1, 16, 17, 64, 65, 129, 513, 4097)] == [16, 16, 32, 64, 96, 160, 640, 4608]
    from latim_jax.latim.dataset import Prompt

    prompts = [Prompt(str(k), tuple([1] * n), k) for k, n in enumerate([5, 1, 9, 5, 2])]
    batches = make_batches(prompts, 2)
    assert [[p.id for p in b] for b in batches] == [["1", "4"], ["0", "3"], ["2"]]


def _direct(model, tokens, rows, method="alti"):
    return latim_jax.attribute(model, np.asarray([tokens]), method=method, rows=rows)


def test_text_file_run_equals_direct_attribution(ckpt, tmp_path, monkeypatch, capsys):
    from latim_jax.cli import main

    monkeypatch.chdir(tmp_path)
    write_lines(tmp_path / "prompts.txt", ["the cat sat on the mat", "a dog", "the dog sat on a cat mat the"])
    for rows in ("all", "last"):
        argv = ["attribute-dataset", "--model", str(ckpt), "--input", "prompts.txt", "--out", f"run-{rows}"]
        assert main(argv + ["--rows", rows, "--batch-size", "2", "--method", "logit", "--quiet"]) == 0
        results = latim_jax.open_results(f"run-{rows}")  # the README's spelling: the package exports it
        assert latim_jax.open_results is open_results
        assert len(results) == 3 and sorted(results) == ["1", "2", "3"]
        model = latim_jax.load(ckpt)
        for pid, text in zip(("1", "2", "3"), open("prompts.txt").read().splitlines(), strict=True):
            ids = [WORDS.index(w) for w in text.split()]
            got = results[pid]
            np.testing.assert_array_equal(np.asarray(got.tokens[0]), ids)
            want = _direct(model, ids, None if rows == "all" else [-1], method="logit")
            np.testing.assert_allclose(got.scores, want.scores, rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(got.extra["logit"], want.extra["logit"], rtol=2e-5)
            assert got.rows == want.rows  # the resolved position (len - 1), as attribute returns it
    # another run's settings into the same directory are refused (a usage error: exit code 2)
    argv = [
        "attribute-dataset",
        "--model",
        str(ckpt),
        "--input",
        "prompts.txt",
        "--out",
        "run-all",
        "--quiet",
    ]
    assert main(argv) == 2 and "holds the results of a different run" in capsys.readouterr().err


@pytest.mark.slow
def test_sigkill_then_rerun_gives_every_prompt_once(ckpt, tmp_path):
    rng = np.random.default_rng(0)
    lengths = [3, 20, 37, 55, 70, 90, 3, 20]  # several buckets: each batch compiles, so the run is slow
    lines = [
        json.dumps({"id": f"q{k}", "tokens": rng.integers(0, 16, n).tolist()}) for k, n in enumerate(lengths)
    ]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "latim_jax.cli", "attribute-dataset", "--model", str(ckpt)]
    cmd += ["--input", str(inp), "--out", str(out), "--batch-size", "1", "--method", "l2", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not list(out.glob("shard-*.npz")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = sorted(p.name for p in out.glob("shard-*.npz"))
    assert 1 <= len(first) < len(lengths), first  # killed mid-run
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{len(lengths) - len(first)} prompts attributed, {len(first)} already there" in done.stdout
    results = open_results(out)
    assert sorted(results) == sorted(f"q{k}" for k in range(len(lengths)))
    ids = [pid for shard in sorted(out.glob("shard-*.npz")) for pid in _ids(shard)]
    assert sorted(ids) == sorted(results)  # no prompt written twice
    assert not list(out.glob(".tmp-*"))
    model = latim_jax.load(ckpt)
    for k, line in enumerate(lines):
        tokens = json.loads(line)["tokens"]
        want = _direct(model, tokens, None, method="l2").scores
        np.testing.assert_allclose(results[f"q{k}"].scores, want, rtol=2e-5, atol=1e-6)


def _ids(shard):
    with np.load(shard) as z:
        return json.loads(bytes(z["index"]).decode())["ids"]


def test_another_input_into_the_same_directory_is_refused(ckpt, tmp_path, monkeypatch, capsys):
    """Results of two inputs never mix: an input whose prompts changed, grew or shrank is refused
    (API and CLI, exit code 2), the same input resumes, and a directory written before the input was
    recorded is checked against the tokens its shards hold."""
    from latim_jax.cli import main
    from latim_jax.latim.dataset import PROMPTS_FILE, attribute_dataset

    model = latim_jax.load(ckpt)
    monkeypatch.chdir(tmp_path)
    a = read_prompts(write_lines(tmp_path / "a.txt", ["the cat sat", "a dog"]), vocab_size=16,
                     tokenize=lambda t: [WORDS.index(w) for w in t.split()])  # fmt: skip
    b = read_prompts(write_lines(tmp_path / "b.txt", ["the mat", "a cat sat on"]), vocab_size=16,
                     tokenize=lambda t: [WORDS.index(w) for w in t.split()])  # fmt: skip
    options = dict(method="l2", progress=False)
    assert attribute_dataset(model, a, "run", **options)["computed"] == 2
    with pytest.raises(DatasetError, match=r"another input .* 2 with other tokens \(ids \['1', '2'\]\)"):
        attribute_dataset(model, b, "run", **options)
    with pytest.raises(DatasetError, match=r"1 new \(ids \['3'\]\)"):
        attribute_dataset(model, a + [dataclasses.replace(a[0], id="3")], "run", **options)
    with pytest.raises(DatasetError, match=r"1 not in this input \(ids \['2'\]\)"):
        attribute_dataset(model, a[:1], "run", **options)
    assert attribute_dataset(model, a, "run", **options)["done_before"] == 2  # the same input resumes
    argv = ["attribute-dataset", "--model", str(ckpt), "--input", "b.txt", "--out", "run", "--quiet"]
    assert main(argv + ["--method", "l2"]) == 2
    assert "holds results of another input" in capsys.readouterr().err
    # a run written before prompts.json existed: the shards' tokens stand for the input
    (tmp_path / "run" / PROMPTS_FILE).unlink()
    with pytest.raises(DatasetError, match="2 with other tokens"):
        attribute_dataset(model, b, "run", **options)
    assert attribute_dataset(model, a, "run", **options)["done_before"] == 2
    assert (tmp_path / "run" / PROMPTS_FILE).is_file()  # recorded from now on
    np.testing.assert_array_equal(open_results("run")["1"].tokens[0], a[0].tokens)


def test_an_interrupted_run_warns_and_reads_in_input_order(ckpt, tmp_path):
    """open_results of a run that stopped early warns and names what is missing; results iterate in
    the input's order (the run computes them by length)."""
    from latim_jax.latim.dataset import Prompt, attribute_dataset

    model = latim_jax.load(ckpt)
    lengths = [9, 2, 5, 3]
    prompts = [Prompt(f"p{k}", tuple(range(1, n + 1)), k + 1) for k, n in enumerate(lengths)]
    out = tmp_path / "run"
    attribute_dataset(model, prompts, out, method="l2", batch_size=1, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete run opens silently
        results = open_results(out)
    assert list(results) == ["p0", "p1", "p2", "p3"] and results.complete and results.total == 4
    longest = sorted(out.glob("shard-*.npz"))[-1]  # batches run by length: the last holds p0
    longest.unlink()  # as if the run had been killed before its last batch
    with pytest.warns(UserWarning, match=r"incomplete run: 3 of 4 prompts .*\['p0'\].*rerun the same"):
        results = open_results(out)
    assert list(results) == ["p1", "p2", "p3"] and results.missing == ["p0"] and not results.complete
    counts = attribute_dataset(model, prompts, out, method="l2", batch_size=1, progress=False)
    assert counts["computed"] == 1 and open_results(out).complete


def test_a_hybrid_dataset_run_records_each_layer_kind(tmp_path):
    """A hybrid's dataset results read back with their layer kinds and equal direct attribution."""
    from latim_jax.latim.dataset import attribute_dataset

    model = latim_jax.load("needle-hybrid")
    prompts = read_prompts(write_lines(tmp_path / "p.txt", ["1 2 3 4", "5 6 7"]), vocab_size=65,
                           tokenize=lambda t: [int(w) for w in t.split()])  # fmt: skip
    attribute_dataset(model, prompts, tmp_path / "run", method="alti", progress=False)
    results = open_results(tmp_path / "run")
    got = results[prompts[0].id]
    assert got.layer_kinds == ("mamba2", "attention", "mamba2")
    want = latim_jax.attribute(model, [[1, 2, 3, 4]], method="alti")
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-6)


def test_last_rows_read_back_as_each_prompts_own_position(ckpt, tmp_path):
    """rows="last" is each prompt's own last position, as attribute resolves rows=[-1]: stored per
    prompt in the shard, and a shard written before (rows [-1] for the batch) reads back resolved."""
    from latim_jax.latim.dataset import Prompt, attribute_dataset

    model = latim_jax.load(ckpt)
    prompts = [Prompt(f"p{n}", tuple(range(1, n + 1)), k + 1) for k, n in enumerate([5, 3, 4])]
    out = tmp_path / "run"
    attribute_dataset(model, prompts, out, method="l2", rows="last", batch_size=3, progress=False)
    results = open_results(out)
    for p in prompts:
        want = latim_jax.attribute(model, [list(p.tokens)], method="l2", rows=[-1])
        assert results[p.id].rows == want.rows == (len(p.tokens) - 1,)
    (shard,) = out.glob("shard-*.npz")
    with np.load(shard) as z:
        arrays = dict(z)
    index = json.loads(bytes(arrays["index"]).decode())
    assert index["prompt_rows"] == [[2], [3], [4]]  # by length: p3, p4, p5
    del index["prompt_rows"]  # as written before the field existed
    arrays["index"] = np.frombuffer(json.dumps(index).encode(), np.uint8)
    np.savez(shard, **arrays)
    assert [open_results(out)[p.id].rows for p in prompts] == [(4,), (2,), (3,)]
