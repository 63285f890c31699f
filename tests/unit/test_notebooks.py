"""The tutorial notebooks run top to bottom."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def test_services_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "services.ipynb", as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "300 results" in outputs
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
