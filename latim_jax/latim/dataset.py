"""Attribution over a dataset of prompts: read, batch by length, write shards incrementally, resume.

Input: a .jsonl file, one object per line, ``{"id": ..., "text": "..."}`` (needs the model's
tokenizer) or ``{"id": ..., "tokens": [ints]}``; or any other file read as plain text, one prompt per
line, whose id is its line number (1-based). A bad line (not JSON, empty, no or both of text/tokens,
a repeated id, too long, ids outside the vocabulary) is reported with its line number and skipped
(``on_bad_line="skip"``) or ends the run (``"fail"``, the default): the whole file is read first and
one error lists every bad line (the first :data:`MAX_REPORTED`, then how many more), before anything
is computed.

Ids: a JSON id is a string or an int, and results are keyed by its text (``open_results(out)["7"]``;
``results[7]`` finds it too). An int id and a string id of the same text (``7`` and ``"7"``) would be
one key, so the later line is a bad line naming both (ints and strings mix freely otherwise).

Output directory:
    run.json                  the run's settings (model, method, mode, layers, rows, ...), written first;
                              a rerun with other settings into the same directory is refused
    prompts.json              the input: every prompt's id and a hash of its tokens, in input order; a
                              rerun with another input (a prompt added, dropped or changed) is refused,
                              so two inputs never mix in one directory
    shard-P-NNNNNN.npz        one batch of prompts, written atomically (never a half file), holding per
                              prompt its scores (n_layers, R, L_i) at its own length L_i, its tokens and
                              the extras; its JSON index lists the ids it holds and each one's rows
                              (``prompt_rows``: positions counted from 0, so ``rows="last"`` is
                              ``[L_i - 1]`` per prompt, as :func:`latim_jax.attribute` resolves ``-1``)
A rerun of the same command after an interruption reads the ids already in complete shards and
computes only the missing prompts, so every prompt ends up exactly once. Under several jax processes
(``jax.distributed``) process P takes every P-th prompt (by input order) and writes shard-P-*.

Batches: prompts sorted by length, ``batch_size`` per batch, each padded on the right (with a mask, so
every prompt's scores equal the prompt alone) to its length rounded up to a bucket
(:func:`latim_jax.model.inputs.bucket_length`), so a run compiles a handful of shapes, not one per length.

Reading back: :func:`open_results` (a lazy mapping id -> :class:`~latim_jax.io.results.Attribution`,
in input order; an interrupted run is reported with a warning, and ``Results.complete`` /
``Results.missing`` say what is missing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.io.atomic import write_bytes_atomic
from latim_jax.io.progress import progress as progress_bar
from latim_jax.io.results import Attribution
from latim_jax.latim.attribution import attribute
from latim_jax.latim.scores import PRECISIONS
from latim_jax.model.inputs import bucket_length

RUN_FILE = "run.json"
PROMPTS_FILE = "prompts.json"
FORMAT = "latim-jax-dataset/1"
PROMPTS_FORMAT = "latim-jax-prompts/1"
MAX_REPORTED = 20  # bad lines listed in one error (all of them are in DatasetError.bad_lines)


class DatasetError(ValueError):
    """A problem with the input file or the output directory (message names the file and line).

    ``bad_lines``: for the input's bad lines, every ``(line number, what is wrong)`` (the message lists
    at most :data:`MAX_REPORTED` of them); empty for other problems."""

    def __init__(self, message: str, bad_lines=()):
        super().__init__(message)
        self.bad_lines: list[tuple[int, str]] = list(bad_lines)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One input prompt: its id (a string), token ids and 1-based line number."""

    id: str
    tokens: tuple[int, ...]
    line: int

    @property
    def digest(self) -> str:
        """A hash of the token ids (what identifies the prompt's content across runs)."""
        return hashlib.sha256(np.asarray(self.tokens, np.int64).tobytes()).hexdigest()[:24]


def read_prompts(
    path,
    *,
    vocab_size: int,
    tokenize=None,
    max_length: int | None = None,
    on_bad_line: str = "fail",
    warn=None,
) -> list[Prompt]:
    """Read prompts from ``path`` (see the module docstring). ``tokenize(text) -> list[int]`` turns
    text into ids (None: text lines are an error naming the missing tokenizer). ``warn(message)`` is
    called for each skipped line (``on_bad_line="skip"``) and for each warning the tokenizer gave on a
    line it read (words it encoded as its unknown token), the line named (without ``warn`` the latter
    are re-issued as warnings). With ``on_bad_line="fail"`` every line is
    read, then one :class:`DatasetError` names every bad line (its ``bad_lines`` holds them all; the
    message the first :data:`MAX_REPORTED`)."""
    if on_bad_line not in ("skip", "fail"):
        raise DatasetError(f"on_bad_line must be 'skip' or 'fail', found {on_bad_line!r}")
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such input file")
    jsonl = path.suffix == ".jsonl"
    prompts, bad = [], []
    seen: dict[str, tuple[object, int]] = {}  # id text -> (the id as given, its line)
    with path.open(encoding="utf-8") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                with warnings.catch_warnings(record=True) as caught:  # the tokenizer's, per line
                    warnings.simplefilter("always")
                    prompt, given = _parse_line(raw, number, jsonl, tokenize, vocab_size, max_length)
                _check_new_id(prompt.id, given, seen)
                seen[prompt.id] = (given, number)
                prompts.append(prompt)
                for w in caught:  # e.g. words the tokenizer encoded as its unknown token
                    if warn is not None:
                        warn(f"{path}:{number}: {w.message}")
                    else:
                        warnings.warn(f"{path}:{number}: {w.message}", w.category, stacklevel=2)
            except DatasetError as err:
                bad.append((number, str(err)))
                if on_bad_line == "skip" and warn is not None:
                    warn(f"skipped {path}:{number}: {err}")
    if bad and on_bad_line == "fail":
        raise DatasetError(_bad_lines_message(path, bad), bad_lines=bad)
    if not prompts:
        raise DatasetError(f"{path}: no prompt to attribute")
    return prompts


def _check_new_id(pid: str, given, seen: dict) -> None:
    """Refuse an id whose text an earlier line already holds: the same id repeated, or an int and a
    string of the same text (one key of the results)."""
    if pid not in seen:
        return
    first, line = seen[pid]
    if type(first) is type(given):
        raise DatasetError(f"repeated id {pid!r} (first on line {line})")
    raise DatasetError(
        f"id {_typed(given)} and id {_typed(first)} on line {line} are one id: results are keyed by "
        "the id's text, so an int id and a string id must differ in their text"
    )


def _typed(pid) -> str:
    return f"the int {pid}" if isinstance(pid, int) else f"the string {pid!r}"


def _bad_lines_message(path: Path, bad: list[tuple[int, str]]) -> str:
    """One error for every bad line: ``path:line: what`` for one, else the count and a bounded list."""
    hint = "pass --on-bad-line skip to skip bad lines"
    if len(bad) == 1:
        number, what = bad[0]
        return f"{path}:{number}: {what} ({hint})"
    listed = "; ".join(f"line {number}: {what}" for number, what in bad[:MAX_REPORTED])
    more = f"; and {len(bad) - MAX_REPORTED} more" if len(bad) > MAX_REPORTED else ""
    return f"{path}: {len(bad)} bad lines, nothing computed ({hint}): {listed}{more}"


def _parse_line(
    raw: str, number: int, jsonl: bool, tokenize, vocab_size: int, max_length
) -> tuple[Prompt, object]:
    """The prompt of one input line and its id as given (an int, a string, or the line number's text
    for a text file); raises :class:`DatasetError` saying what is wrong with the line."""
    text = raw.rstrip("\n")
    if not text.strip():
        raise DatasetError("empty line")
    if jsonl:
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            raise DatasetError(f"not JSON ({err.msg})") from None
        if not isinstance(record, dict) or "id" not in record:
            raise DatasetError('expected an object with "id" and one of "text" / "tokens"')
        if ("text" in record) == ("tokens" in record):
            raise DatasetError('expected exactly one of "text" and "tokens"')
        pid = record["id"]
        if not isinstance(pid, str | int) or isinstance(pid, bool):
            raise DatasetError(f"id must be a string or an int, found {pid!r}")
        if "tokens" in record:
            ids = record["tokens"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise DatasetError('"tokens" must be a list of ints')
        else:
            ids = _tokenize(record["text"], tokenize)
        given, pid = pid, str(pid)
    else:
        pid, ids = str(number), _tokenize(text, tokenize)
        given = pid
    if not ids:
        raise DatasetError("the prompt has no token")
    if max_length is not None and len(ids) > max_length:
        raise DatasetError(f"{len(ids)} tokens, more than the maximum length {max_length}")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise DatasetError(f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return Prompt(id=pid, tokens=tuple(int(t) for t in ids), line=number), given


def _tokenize(text, tokenize):
    if not isinstance(text, str):
        raise DatasetError(f'"text" must be a string, found {type(text).__name__}')
    if tokenize is None:
        raise DatasetError("text needs the model's tokenizer, and this model has none: give token ids")
    try:
        return list(tokenize(text))
    except Exception as err:  # whatever the tokenizer raises: this line is bad, not the run
        raise DatasetError(" ".join(str(err).split()) or type(err).__name__) from None


def bucket(length: int) -> int:
    """The padded length of a batch whose longest prompt has ``length`` tokens
    (:func:`latim_jax.model.inputs.bucket_length`)."""

    return bucket_length(length)


def make_batches(prompts: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    """Prompts sorted by length (then input order), cut into batches of ``batch_size``."""
    if batch_size < 1:
        raise DatasetError(f"batch size must be a positive int, found {batch_size}")
    ordered = sorted(prompts, key=lambda p: (len(p.tokens), p.line))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def run_settings(model, *, method, mode, layers, rows, aggregation, precision="float32") -> dict:
    """The settings that define a run (compared on resume; ``precision`` only when not fp32, so runs
    written before it existed resume as they were)."""
    settings = {
        "format": FORMAT,
        "model": getattr(model, "source", "") or "",
        "config": model.config.to_dict(),
        "method": method,
        "mode": mode,
        "layers": None if layers is None else list(layers),
        "rows": rows,
        "aggregation": aggregation if method == "hidden_attention" else None,
    }
    if precision != "float32":
        settings["precision"] = precision
    return settings


def prepare_output(out_dir, settings: dict, prompts: list[Prompt] | None = None) -> set[str]:
    """Create ``out_dir`` (or reuse it for the same run) and return the ids already done.

    Refuses a directory holding another run's results (other settings, or, when ``prompts`` are given,
    another input: :data:`PROMPTS_FILE`), or files it does not recognise. Leftover temporary files of
    an interrupted write are removed."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DatasetError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    run_file = out / RUN_FILE
    if run_file.exists():
        try:
            previous = json.loads(run_file.read_text())
        except (OSError, ValueError) as err:
            raise DatasetError(f"{run_file}: unreadable ({err})") from err
        if previous != settings:
            diff = sorted(k for k in set(previous) | set(settings) if previous.get(k) != settings.get(k))
            raise DatasetError(
                f"{out} holds the results of a different run (differs in {diff}); use another --out"
            )
    else:
        unknown = [p.name for p in out.iterdir() if not p.name.startswith(".tmp-")]
        if unknown:
            raise DatasetError(
                f"{out} is not empty and holds no {RUN_FILE} ({unknown[:3]}); use another --out"
            )
        write_bytes_atomic(run_file, (json.dumps(settings, indent=2, sort_keys=True) + "\n").encode())
    for leftover in out.glob(".tmp-*"):
        leftover.unlink(missing_ok=True)
    done = {pid for shard in _shards(out) for pid in _shard_index(shard)["ids"]}
    if prompts is not None:
        _check_input(out, prompts, done)
    return done


def _manifest(prompts: list[Prompt]) -> dict:
    return {"format": PROMPTS_FORMAT, "total": len(prompts), "prompts": [[p.id, p.digest] for p in prompts]}


def _check_input(out: Path, prompts: list[Prompt], done: set[str]) -> None:
    """Refuse an input other than the one the directory's results came from (the recorded
    :data:`PROMPTS_FILE`; for a directory written before it existed, the tokens stored in its shards);
    record it when absent."""
    path = out / PROMPTS_FILE
    current = {p.id: p.digest for p in prompts}
    if path.exists():
        try:
            recorded = dict(map(tuple, json.loads(path.read_text())["prompts"]))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DatasetError(f"{path}: unreadable ({err})") from err
    else:  # the run's results so far, from the tokens its shards hold
        recorded = {}
        for shard in _shards(out):
            with np.load(shard, allow_pickle=False) as z:
                for b, pid in enumerate(_shard_index(shard)["ids"]):
                    tokens = tuple(int(t) for t in z[f"p{b}/tokens"])
                    recorded[pid] = Prompt(pid, tokens, 0).digest
    partial = not path.exists()  # only the done prompts are known: others may be new
    changed = sorted(pid for pid in current.keys() & recorded.keys() if current[pid] != recorded[pid])
    gone = sorted(recorded.keys() - current.keys())
    new = [] if partial else sorted(current.keys() - recorded.keys())
    if changed or gone or new:
        parts = [
            f"{len(ids)} {what} (ids {ids[:5]}{' ...' if len(ids) > 5 else ''})"
            for ids, what in ((changed, "with other tokens"), (gone, "not in this input"), (new, "new"))
            if ids
        ]
        raise DatasetError(
            f"{out} holds results of another input than this one: prompts {'; '.join(parts)}. Results of "
            "two inputs are never mixed: use another --out, or the same input to resume"
        )
    if partial:
        write_bytes_atomic(path, (json.dumps(_manifest(prompts)) + "\n").encode())


def prompt_rows(rows, length: int) -> list[int] | None:
    """The rows of one prompt of ``length`` tokens as positions from 0 (None: every row): a negative
    row counts back from the prompt's last token, as :func:`latim_jax.attribute` resolves it."""
    return None if rows is None else [int(r) + length if r < 0 else int(r) for r in rows]


def write_shard(out_dir, process: int, number: int, prompts: list[Prompt], result: Attribution) -> Path:
    """Write one batch's results atomically: per prompt its own-length scores, tokens and extras, and
    in the index its rows as positions (``prompt_rows``; the batch's ``result.rows`` may count back
    from each prompt's end, ``(-1,)`` for ``rows="last"``)."""
    index = {
        "ids": [],
        "prompt_rows": [],
        "method": result.method,
        "mode": result.mode,
        "layers": list(result.layers),
        "rows": result.rows,
        "aggregation": result.aggregation,
        "model": result.model,
        "precision": result.precision,
        "n_layers": result.n_layers,
        "layer_kinds": None if result.layer_kinds is None else list(result.layer_kinds),
    }
    arrays = {}
    scores = np.asarray(result.scores)
    extra = {k: np.asarray(v) for k, v in result.extra.items()}
    for b, prompt in enumerate(prompts):
        n = len(prompt.tokens)
        key = f"p{b}"
        index["ids"].append(prompt.id)
        index["prompt_rows"].append(prompt_rows(result.rows, n))
        s = scores[b][..., :n]
        arrays[f"{key}/scores"] = s if result.rows is not None else s[:, :n]
        arrays[f"{key}/tokens"] = np.asarray(prompt.tokens, np.int32)
        for name, value in extra.items():
            arrays[f"{key}/extra/{name}"] = _trim_extra(name, value[b], n, result.rows is None)
    arrays["index"] = np.frombuffer(json.dumps(index).encode(), np.uint8)
    path = Path(out_dir) / f"shard-{process}-{number:06d}.npz"
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_bytes_atomic(path, buf.getvalue())
    return path


def _trim_extra(name: str, value: np.ndarray, n: int, all_rows: bool) -> np.ndarray:
    """An extra of one prompt cut to its own length (the row axis only when every row was scored)."""
    if name == "targets":
        return value[:n]
    if name == "approximation_error":
        return value
    if name == "alti":  # (n_layers, L, L)
        return value[:, :n, :n]
    if name == "bias":  # (n_layers, R)
        return value[:, :n] if all_rows else value
    return value[:n] if all_rows else value  # direct / logit (R,)


def _shards(out: Path) -> list[Path]:
    return sorted(out.glob("shard-*.npz"))


def _shard_index(path: Path) -> dict:
    try:
        with np.load(path, allow_pickle=False) as z:
            return json.loads(bytes(z["index"]).decode())
    except (OSError, KeyError, ValueError) as err:
        raise DatasetError(f"{path}: unreadable shard ({err}); remove it to recompute its prompts") from err


class Results(Mapping):
    """Results of a dataset run: a read-only mapping from prompt id to :class:`Attribution`, loaded
    lazily from the shard that holds it (each Attribution is one prompt: B = 1, at its own length)."""

    def __init__(self, out_dir):
        self.path = Path(out_dir)
        if not (self.path / RUN_FILE).is_file():
            raise DatasetError(f"{self.path}: not a latim-jax dataset run (no {RUN_FILE})")
        self.settings = json.loads((self.path / RUN_FILE).read_text())
        where: dict[str, tuple[Path, int]] = {}
        for shard in _shards(self.path):
            for b, pid in enumerate(_shard_index(shard)["ids"]):
                where[pid] = (shard, b)
        manifest = self.path / PROMPTS_FILE
        if manifest.is_file():
            try:
                order = [pid for pid, _ in json.loads(manifest.read_text())["prompts"]]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise DatasetError(f"{manifest}: unreadable ({err})") from err
        else:  # a run written before the file existed: its extent is unknown
            order = None
        self.total: int | None = None if order is None else len(order)
        self.missing: list[str] = [] if order is None else [pid for pid in order if pid not in where]
        ordered = [] if order is None else [pid for pid in order if pid in where]
        ordered += sorted(where.keys() - set(ordered), key=lambda pid: where[pid])  # in no input
        self._where = {pid: where[pid] for pid in ordered}

    @property
    def complete(self) -> bool | None:
        """Whether every prompt of the input has its result (None for a run written before the input
        was recorded)."""
        return None if self.total is None else not self.missing

    def __getitem__(self, pid) -> Attribution:
        shard, b = self._where[str(pid)]
        with np.load(shard, allow_pickle=False) as z:
            index = json.loads(bytes(z["index"]).decode())
            key = f"p{b}"
            tokens = z[f"{key}/tokens"]
            if "prompt_rows" in index:
                rows = index["prompt_rows"][b]
            else:  # a shard written before the field: its batch's rows, -1 for each one's last
                rows = prompt_rows(index["rows"], len(tokens))
            extra = {
                name.split("/", 2)[2]: jnp.asarray(z[name])[None]
                for name in z.files
                if name.startswith(f"{key}/extra/")
            }
            return Attribution(
                scores=jnp.asarray(z[f"{key}/scores"])[None],
                tokens=jnp.asarray(tokens)[None],
                extra=extra,
                method=index["method"],
                mode=index["mode"],
                layers=tuple(index["layers"]),
                rows=None if rows is None else tuple(rows),
                model=index["model"],
                aggregation=index["aggregation"],
                precision=index.get("precision", "float32"),  # shards written before the field: fp32
                n_layers=index.get("n_layers"),
                layer_kinds=None if index.get("layer_kinds") is None else tuple(index["layer_kinds"]),
            )

    def __iter__(self) -> Iterator[str]:
        """Prompt ids in input order (those attributed so far)."""
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def open_results(out_dir) -> Results:
    """The results of ``latim-jax attribute-dataset`` (or :func:`attribute_dataset`) in ``out_dir``:
    a lazy mapping from prompt id (a string) to a one-prompt :class:`Attribution`, in input order.
    Its ``rows`` are positions in the prompt (a ``rows="last"`` run: ``(L_i - 1,)``), as
    :func:`latim_jax.attribute` returns them.

    An interrupted run opens with a warning naming how many prompts are missing (``Results.missing``;
    rerun the same command to finish it)."""
    results = Results(out_dir)
    if results.missing:
        warnings.warn(
            f"{results.path}: an incomplete run: {len(results)} of {results.total} prompts attributed "
            f"({len(results.missing)} missing, e.g. ids {results.missing[:3]}); rerun the same command to "
            "finish it",
            stacklevel=2,
        )
    return results


def attribute_dataset(
    model,
    prompts: list[Prompt],
    out_dir,
    *,
    method: str = "alti",
    mode: str = "exact",
    layers=None,
    rows: str = "all",
    batch_size: int = 8,
    aggregation: str = "minmax",
    impl: str = "auto",
    precision: str = "float32",
    progress: bool | None = None,
) -> dict:
    """Attribute every prompt into ``out_dir`` (see the module docstring), skipping the ids already
    there. ``rows``: "all" or "last" (each prompt's own last token: read back with ``rows == (L_i - 1,)``,
    its position, as :func:`latim_jax.attribute` resolves ``rows=[-1]``).
    ``precision``: as for :func:`latim_jax.attribute` (part of the run's settings).
    ``progress``: a bar on stderr (None: when stderr is a terminal). Returns counts
    {"total", "done_before", "computed", "shards"}."""
    if rows not in ("all", "last"):
        raise DatasetError(f"rows must be 'all' or 'last', found {rows!r}")
    if precision not in PRECISIONS:  # before run.json is written
        raise DatasetError(f"precision must be one of {PRECISIONS}, found {precision!r}")
    settings = run_settings(model, method=method, mode=mode, layers=layers, rows=rows,
                            aggregation=aggregation, precision=precision)  # fmt: skip
    done = prepare_output(out_dir, settings, prompts)
    mine = [p for k, p in enumerate(prompts) if k % jax.process_count() == jax.process_index()]
    todo = [p for p in mine if p.id not in done]
    batches = make_batches(todo, batch_size)
    process = jax.process_index()
    number = 1 + max((int(s.stem.rsplit("-", 1)[1]) for s in Path(out_dir).glob(f"shard-{process}-*.npz")),
                     default=0)  # fmt: skip
    computed = 0
    options = dict(method=method, mode=mode, layers=layers, impl=impl, precision=precision)
    if method == "hidden_attention":  # attribute refuses an aggregation for the methods that ignore it
        options["aggregation"] = aggregation
    for batch in progress_bar(batches, desc="attribute-dataset", unit="batch", enabled=progress):
        length = bucket(max(len(p.tokens) for p in batch))
        tokens = np.zeros((len(batch), length), np.int32)
        mask = np.zeros((len(batch), length), bool)
        for b, p in enumerate(batch):
            tokens[b, : len(p.tokens)] = p.tokens
            mask[b, : len(p.tokens)] = True
        if rows == "last":
            result = _last_rows(model, tokens, mask, batch, options)
        else:
            result = attribute(model, tokens, mask=mask, **options)
        write_shard(out_dir, process, number, batch, result)
        number += 1
        computed += len(batch)
    return {
        "total": len(mine),
        "done_before": len(mine) - len(todo),
        "computed": computed,
        "shards": number - 1,
    }


def _last_rows(model, tokens, mask, batch, options: dict) -> Attribution:
    """Each prompt's own last row: one call per distinct last position in the batch (prompts of one
    batch have nearly equal lengths), gathered into one Attribution with rows = (last,) per prompt.
    ``options``: the keyword arguments of :func:`latim_jax.attribute` but rows and mask."""
    last = np.asarray([len(p.tokens) - 1 for p in batch])
    scores, extras, first = [None] * len(batch), [None] * len(batch), None
    for position in sorted(set(last.tolist())):
        which = np.flatnonzero(last == position)
        res = attribute(model, tokens[which], rows=[position], mask=mask[which], **options)
        first = first or res
        for k, b in enumerate(which):
            scores[b] = res.scores[k]
            extras[b] = {name: value[k] for name, value in res.extra.items()}
    return dataclasses.replace(
        first,
        scores=jnp.stack(scores),
        tokens=jnp.asarray(tokens),
        extra={name: jnp.stack([e[name] for e in extras]) for name in extras[0]},
        rows=(-1,),
        mask=None,
    )
