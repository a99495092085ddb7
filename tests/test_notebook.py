"""The quickstart notebook runs top to bottom, so it never rots."""

from pathlib import Path

import pytest

NB = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NB, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "autopar plan for gpt3-1.3b" in outputs
    assert "baselines under the same cost model" in outputs
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert (tmp_path / "quickstart_plan.png").exists()
    assert "autopar sweep: gpt3-1.3b" in outputs and (tmp_path / "quickstart_sweep.png").exists()
    losses = [float(line.split()[3]) for line in outputs.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses)
