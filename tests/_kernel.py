"""Cells run in a real Jupyter kernel (ipykernel, through nbclient), as a notebook runs them."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest


def run_cells(cells: list[str], folder: Path, timeout: float = 120) -> list[str]:
    """Run ``cells`` in order in one fresh ``python3`` kernel whose working folder is ``folder``.

    Returns:
        each cell's output as one text: its stdout and stderr streams, its results' ``text/plain``, and, for
        a cell that raised, ``<name>: <value>`` (the kernel goes on to the next cell; an error does not stop
        the run).
    """
    nbformat = pytest.importorskip("nbformat")
    notebook = run_notebook(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), folder,
                            timeout=timeout)
    return [_text(cell.outputs) for cell in notebook.cells]


def run_notebook(notebook: Any, folder: Path, *, timeout: float = 120,
                 interrupt: tuple[int, Path] | None = None) -> Any:
    """Executes ``notebook`` (an nbformat notebook, changed in place and returned: each cell's ``outputs``)
    in one fresh ``python3`` kernel whose working folder is ``folder``; an error does not stop the run.

    ``interrupt``: ``(cell, path)``: while cell ``cell`` runs, the kernel is interrupted once ``path`` exists,
    as the notebook's stop button does (SIGINT to the kernel)."""
    nbclient = pytest.importorskip("nbclient", reason="needs nbclient and ipykernel (the dev extra)")
    pytest.importorskip("ipykernel")
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=timeout, allow_errors=True,
                                     resources={"metadata": {"path": str(folder)}})
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            watcher = None
            if interrupt is not None and interrupt[0] == index:
                watcher = threading.Thread(target=_interrupt_once, args=(client, interrupt[1], time.monotonic()
                                                                         + timeout), daemon=True)
                watcher.start()
            client.execute_cell(cell, index)
            if watcher is not None:
                watcher.join(timeout=5)
    return notebook


def _interrupt_once(client: Any, path: Path, deadline: float) -> None:
    from jupyter_core.utils import run_sync

    while not path.exists():
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    run_sync(client.km.interrupt_kernel)()


def _text(outputs: list) -> str:
    parts = []
    for out in outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", "") + "\n")
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}\n")
    return "".join(parts)
