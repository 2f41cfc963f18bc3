"""Run the quickstart notebook headless and print its outputs: ``python -m jupyter_ring.demo``.

Executes ``notebooks/01-quickstart.ipynb`` with nbclient on a kernel of the current Python
environment. IPython, Jupyter and ipyparallel files go to a temporary directory unless
IPYTHONDIR / JUPYTER_* are already set, so the demo leaves nothing in the home folder.

The kernel listens on Unix sockets in an owner-only temporary folder (jupyter_client's ``ipc``
transport), not on TCP ports: no other user of the machine can connect to it, and it starts
without ipykernel's warning about unencrypted TCP.
"""

import argparse
import os
import re
import sys
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nbformat import NotebookNode

__all__ = ["main", "run_notebook", "format_outputs", "NOTEBOOK"]

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "notebooks", "01-quickstart.ipynb")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _isolate(tmp: str) -> None:
    for var, sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter_config"),
                     ("JUPYTER_DATA_DIR", "jupyter_data"), ("JUPYTER_RUNTIME_DIR", "jupyter_runtime")):
        if not os.environ.get(var):
            os.environ[var] = os.path.join(tmp, sub)
            os.makedirs(os.environ[var], exist_ok=True)


def run_notebook(path: str = NOTEBOOK, timeout: float = 120) -> "NotebookNode":
    """Execute the notebook (a copy in memory); return the executed nbformat notebook.

    A cell that fails, unless tagged ``raises-exception``, stops the run with nbclient's
    ``CellExecutionError``, whose ``notebook`` attribute is the notebook as far as it ran (every
    cell's outputs until the failing one's, included)."""
    import nbformat
    from jupyter_client.kernelspec import NATIVE_KERNEL_NAME
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from traitlets.config import Config

    nb: NotebookNode = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="jupyter_ring_kernel_") as sockets:  # mode 0700
        config = Config()
        config.KernelManager.transport = "ipc"
        config.KernelManager.ip = os.path.join(sockets, "kernel")  # sockets: kernel-<port>
        # the native kernel runs sys.executable: this environment, wherever the notebook came from
        client = NotebookClient(nb, timeout=timeout, kernel_name=NATIVE_KERNEL_NAME, config=config,
                                resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}})
        try:
            client.execute()
        except CellExecutionError as exc:
            exc.notebook = nb  # type: ignore[attr-defined]  # our attribute on nbclient's error, read by the tests
            raise
    return nb


def format_outputs(nb: "NotebookNode") -> str:
    """The notebook's code cells and their text outputs, as a transcript."""
    lines: list[str] = []
    count = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        count += 1
        first, *rest = cell.source.splitlines() or [""]
        lines.append(f"In [{count}]: {first}")
        lines.extend(f"   ...: {line}" for line in rest)
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                lines.extend(out.text.rstrip("\n").splitlines())
            elif out.output_type in ("execute_result", "display_data"):
                text = out.get("data", {}).get("text/plain", "")
                prefix = f"Out[{count}]: " if out.output_type == "execute_result" else ""
                lines.append(prefix + text)
            elif out.output_type == "error":
                lines.extend(_ANSI.sub("", line) for line in out.traceback)
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jupyter_ring.demo", description=__doc__.splitlines()[0])
    parser.add_argument("notebook", nargs="?", default=NOTEBOOK, help="notebook to run (default: the quickstart)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per cell (default 120)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jupyter_ring_demo_") as tmp:
        _isolate(tmp)
        nb = run_notebook(args.notebook, timeout=args.timeout)
    print(format_outputs(nb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
