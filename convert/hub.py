"""Turning a checkpoint source into a local directory: a local path as is, anything else as a Hugging
Face hub id fetched with ``huggingface_hub.snapshot_download`` (config, weights and tokenizer files
only, and only one weight layout when a repository holds several).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from .errors import SourceUnavailableError

CONFIG_PATTERNS = ["config.json", "params.json", "latim_config.json"]
TOKENIZER_PATTERNS = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tokenizer.model.v3",
]
# Weight layouts in preference order; the first one a repository has is the one fetched.
WEIGHT_LAYOUTS = (
    ("model.safetensors.index.json", ["model.safetensors.index.json", "model-*.safetensors"]),
    ("model.safetensors", ["model.safetensors"]),
    ("consolidated.safetensors", ["consolidated.safetensors"]),
    ("pytorch_model.bin.index.json", ["pytorch_model.bin.index.json", "pytorch_model-*.bin"]),
    ("pytorch_model.bin", ["pytorch_model.bin"]),
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def resolve_source(
    source: str | os.PathLike[str], *, revision: str | None = None, cache_dir: Any = None
) -> Path:
    """A local checkpoint directory for ``source``: a local directory, or a hub id ("owner/name").

    A hub id is fetched into the Hugging Face cache (``cache_dir`` if given) unless offline
    (``HF_HUB_OFFLINE=1``), when only the cache is used. Raises :class:`SourceUnavailableError`
    saying the id could not be fetched (and that a local path may be given instead) when the hub
    cannot be reached, the id does not exist, or ``source`` is a path that does not exist.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return path.absolute()
    if path.exists():
        raise SourceUnavailableError(
            "a checkpoint source must be a directory", file=source, expected="a directory", found="a file"
        )
    text = str(source)
    if not _HUB_ID.match(text) or text.startswith((".", "~")):
        raise SourceUnavailableError(
            "no such local checkpoint directory (and not a hub id)",
            file=source,
            expected="a directory",
            found="nothing",
        )
    return _download(text, revision=revision, cache_dir=cache_dir)


def allow_patterns(repo_files: list[str] | None) -> list[str]:
    """The files to fetch: config and tokenizer files plus the first weight layout present in
    ``repo_files`` (all layouts when the listing is unknown, e.g. offline)."""
    patterns = CONFIG_PATTERNS + TOKENIZER_PATTERNS
    if repo_files is None:
        return patterns + [p for _, layout in WEIGHT_LAYOUTS for p in layout]
    for marker, layout in WEIGHT_LAYOUTS:
        if marker in repo_files:
            if marker == "consolidated.safetensors":
                patterns = [p for p in patterns if p != "config.json"]  # read it as Codestral
            return patterns + layout
    return patterns


def _download(repo_id: str, *, revision: str | None, cache_dir: Any) -> Path:
    try:
        import huggingface_hub
    except ImportError as err:
        raise _unavailable(repo_id, "huggingface_hub is not installed") from err
    offline = _offline()
    files, reason = None, ""
    if not offline:
        try:
            files = _repo_files(huggingface_hub, repo_id, revision)
        except Exception as err:  # unknown or gated repo: a clear error at once
            if not _is_connection_error(err):
                raise _unavailable(repo_id, f"{type(err).__name__}: {err}") from err
            # the hub cannot be reached: use the local cache only (no retry loop)
            offline, reason = True, f"the hub cannot be reached ({type(err).__name__}: {err}) and "
    try:
        local = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=allow_patterns(files),
            local_files_only=offline,
        )
    except Exception as err:  # network, offline mode, unknown repo, gated repo: all mean "not fetched"
        if offline:
            why = reason or "offline mode (HF_HUB_OFFLINE) and "
            raise _unavailable(repo_id, f"{why}it is not in the local Hugging Face cache") from err
        raise _unavailable(repo_id, f"{type(err).__name__}: {err}") from err
    return Path(local).absolute()


def _repo_files(huggingface_hub, repo_id: str, revision: str | None) -> list[str]:
    """The repository's file names, in one request (``list_repo_files`` retries a failed connection
    with back-off for about 25 s; ``model_info`` fails at once)."""
    info = huggingface_hub.model_info(repo_id, revision=revision, timeout=10)
    return [s.rfilename for s in info.siblings or []]


def _is_connection_error(err: BaseException) -> bool:
    """Whether ``err`` means the hub could not be reached (no network, DNS, timeout, proxy)."""
    names = {c.__name__ for c in type(err).__mro__}
    network = {"ConnectError", "ConnectTimeout", "TimeoutException", "NetworkError", "TransportError"}
    return bool(names & (network | {"ConnectionError", "TimeoutError", "OfflineModeIsEnabled"}))


def _offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    if flag.strip().upper() in {"1", "ON", "YES", "TRUE"}:
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _unavailable(repo_id: str, reason: str) -> SourceUnavailableError:
    return SourceUnavailableError(
        f"could not fetch hub id {repo_id!r} ({reason}); pass a local checkpoint directory instead",
        file=repo_id,
    )
