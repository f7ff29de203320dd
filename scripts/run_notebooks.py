"""Execute the notebooks in place so that they are committed with their outputs (figures, numbers), and
print how long each took.

    python scripts/run_notebooks.py                      # every notebook, full settings
    python scripts/run_notebooks.py quickstart --tiny    # one, with LATIM_NOTEBOOK_TINY=1 (as CI runs them)

Each notebook runs in its own kernel with the notebooks/ folder as working directory (files it writes
land there and are ignored by git); a notebook that raises is left unchanged and the script exits 1.
The file is replaced atomically.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
# what a reader should not find in a committed output: progress bars, tqdm's "IProgress not found"
# (with this machine's site-packages path), transformers' notes that its CUDA kernels are absent
QUIET = {
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "PYTHONWARNINGS": "ignore:IProgress not found",
}


def run(path: Path, tiny: bool, timeout: int) -> float:
    """Execute ``path`` in place; returns the seconds it took."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    env = {**os.environ, "MPLBACKEND": "module://matplotlib_inline.backend_inline", **QUIET}
    env.pop("LATIM_NOTEBOOK_TINY", None)
    if tiny:
        env["LATIM_NOTEBOOK_TINY"] = "1"
    start = time.perf_counter()
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute(env=env)
    took = time.perf_counter() - start
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".ipynb")
    os.close(fd)
    nbformat.write(nb, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return took


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="notebook names without .ipynb (default: all)")
    p.add_argument("--tiny", action="store_true", help="LATIM_NOTEBOOK_TINY=1: small settings")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per cell (default 3600)")
    args = p.parse_args(argv)
    paths = [NOTEBOOKS / f"{n}.ipynb" for n in args.names] or sorted(NOTEBOOKS.glob("*.ipynb"))
    missing = [str(x) for x in paths if not x.is_file()]
    if missing:
        print(f"error: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    failed = 0
    for path in paths:
        try:
            took = run(path, args.tiny, args.timeout)
            print(f"{path.name}: {took:.0f} s", flush=True)
        except Exception as err:  # nbclient's CellExecutionError names the cell and the traceback
            failed += 1
            print(f"{path.name}: FAILED ({' '.join(str(err).split())[:500]})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
