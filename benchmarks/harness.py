"""What the benchmark drivers share: guarded measurement subprocesses, machine facts, fits, output files.

Standard library only (numpy for the fit): the drivers stay small processes, every measurement runs in a
child of its own (benchmarks/workers.py) so its peak memory is its own, and a guard polls the child's
resident memory and kills it above a cap (or when the machine itself runs short), so a configuration
that does not fit records "oom" instead of taking the machine down.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "workers.py"
RESULTS = HERE / "results"
GIB = 2**30


def _status_kib(path: str, key: str) -> int | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else None


def mem_available_gib() -> float:
    """MemAvailable of the machine (GiB)."""
    kib = _status_kib("/proc/meminfo", "MemAvailable")
    return float("nan") if kib is None else kib / 2**20


def run_worker(spec: dict, *, cap_gib: float, timeout_s: float, reserve_gib: float = 1.0, poll_s=0.05):
    """Run ``workers.py`` on ``spec`` under the memory guard; returns its JSON result plus ``status``.

    status: "ok"; "oom" (the child's RSS passed ``cap_gib``: killed, "OOM at cap"); "oom-machine"
    (MemAvailable fell under ``reserve_gib``: killed to protect the shared machine); "timeout"; "error"
    (non-zero exit; ``error`` holds the last stderr lines). ``guard_peak_gib``: the largest RSS the
    guard saw (sampled every ``poll_s``; the child's own VmHWM is exact).
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(spec)], stdout=out, stderr=err, env=env, text=True
        )
        status, peak = None, 0.0
        status_file = f"/proc/{proc.pid}/status"
        while proc.poll() is None:
            kib = _status_kib(status_file, "VmRSS")
            if kib is not None:
                peak = max(peak, kib / 2**20)
            if peak > cap_gib:
                status = "oom"
            elif mem_available_gib() < reserve_gib:
                status = "oom-machine"
            elif time.perf_counter() - t0 > timeout_s:
                status = "timeout"
            if status:
                proc.kill()
                proc.wait()
                break
            time.sleep(poll_s)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    base = {
        "status": status or "ok",
        "guard_peak_gib": peak,
        "process_wall_s": wall,
        "cap_gib": cap_gib,
        "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],  # before, after: > cores = shared
    }
    if status:
        return base
    if proc.returncode != 0:
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-3:]
        return {**base, "status": "error", "error": " | ".join(tail)}
    lines = [ln for ln in stdout.strip().splitlines() if ln.startswith("{")]
    if not lines:
        return {**base, "status": "error", "error": "no JSON line on stdout"}
    return {**json.loads(lines[-1]), **base}


def quick_defaults(parser, args, values: dict) -> None:
    """--quick: every option the command line left at its default takes its quick value instead."""
    for key, value in values.items():
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)


def machine() -> dict:
    """CPU model, cores, RAM, OS, load average (the facts every result file carries)."""
    cpu = "unknown"
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    total = _status_kib("/proc/meminfo", "MemTotal")
    flags = ""
    try:
        m = re.search(r"^flags\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")
        flags = " ".join(f for f in (m.group(1).split() if m else []) if f in wanted)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "ram_gib": None if total is None else round(total / 2**20, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "nice": os.nice(0),
    }


def fit_exponent(xs, ys) -> float | None:
    """Least-squares slope of log(y) on log(x) (y ~ x^slope); None for fewer than 2 usable points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x and y and x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return None if sxx == 0 else sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; results are ordinary readable files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: dict) -> None:
    """Atomically write ``data`` as indented JSON (NaN/inf as null)."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    write_atomic(path, json.dumps(clean(data), indent=1) + "\n")


def fmt(x, spec=".2f", none="-") -> str:
    """Format a number for a table (``none`` for missing values)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def rates_heading(result: dict) -> str:
    """Heading of a result's rates table (older files measured the rates at the start only)."""
    when = "the best of its start and end" if "rates_end" in result else "measured at its start"
    return f"### This machine's rates (same job; {when})\n"


def describe_failure(rec: dict) -> str:
    """A short cell for a record that did not complete."""
    s = rec.get("status", "?")
    if s == "oom":
        return f"OOM at {rec.get('cap_gib', '?'):g} GiB"
    if s == "oom-machine":
        return "OOM (machine)"
    if s == "timeout":
        return "timeout"
    if s == "skipped":
        return "skipped (" + rec.get("reason", "") + ")"
    return s


def now() -> str:
    """Local time, ISO format, seconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def log(msg: str) -> None:
    """Progress line on stderr (the result table goes to stdout, last)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
