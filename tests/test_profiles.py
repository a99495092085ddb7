"""Bundled hardware profiles load, and every figure in them says where it comes from."""

from __future__ import annotations

import pytest
import yaml

import autopar
from autopar.schema.cluster import bundled_profiles_dir

PROFILES = ["dgx-a100-80g", "dgx-a100-40g", "dgx-h100", "hgx-h200", "p3.16xlarge", "cpu"]
NOT_FIGURES = {"name", "sources", "measured"}


def test_the_bundled_set_is_there() -> None:
    assert set(PROFILES) <= set(autopar.bundled_clusters())


@pytest.mark.parametrize("name", PROFILES)
def test_profile_loads_and_every_figure_has_a_source(name: str) -> None:
    c = autopar.ClusterSpec.load(name, num_nodes=2 if name != "cpu" else None)
    raw = yaml.safe_load((bundled_profiles_dir() / f"{name}.yaml").read_text())
    for section in ("device", "intra_node", "inter_node"):
        if section not in raw:
            continue
        srcs = raw[section].get("sources", {})
        for key in raw[section]:
            if key not in NOT_FIGURES:
                assert srcs.get(key), f"{name}: {section}.{key} has no source"
        if raw[section].get("measured"):
            assert srcs.get("measured"), f"{name}: {section}.measured has no source"
    assert c.device.memory_bytes > 0 and c.intra_node.bandwidth > 0


@pytest.mark.parametrize("name,peak,hbm", [("dgx-a100-80g", 312e12, 80), ("dgx-a100-40g", 312e12, 40),
                                           ("dgx-h100", 989e12, 80), ("hgx-h200", 989e12, 141),
                                           ("p3.16xlarge", 125e12, 16)])
def test_published_figures(name: str, peak: float, hbm: float) -> None:
    c = autopar.ClusterSpec.load(name, num_nodes=2)
    assert c.device.peak("bf16") == peak
    assert c.device.memory_bytes / 2**30 == pytest.approx(hbm, rel=0.07)
    assert c.devices_per_node == 8 and c.inter_node is not None
    assert c.inter_node.bandwidth < c.intra_node.bandwidth       # NICs are slower than NVLink
    curve = sorted((p.flops, p.efficiency) for pts in c.device.gemm_efficiency.values() for p in pts)
    # up to 1e11 FLOPs bigger GEMMs are no worse; beyond, measured curves wander by shape (the A100
    # one dips 4% at 6e11: an M = 2048 shape of a different sweep), within a few percent of the top
    rising = [e for f, e in curve if f <= 1e11]
    assert rising and all(e0 <= e1 for e0, e1 in zip(rising, rising[1:]))
    top = max(e for _, e in curve)
    assert all(e >= 0.9 * top for f, e in curve if f > 1e11)
    assert top < 0.9                                             # never the datasheet peak


@pytest.mark.parametrize("name", ["dgx-a100-80g", "dgx-a100-40g", "dgx-h100", "hgx-h200"])
def test_every_figure_is_in_the_constants_inventory(name: str) -> None:
    """Issue 14: docs/constants.md indexes every figure of the A100 / H100 / H200 profiles with its
    status (measured, derived, datasheet, transferred, estimate); a figure added to a profile
    without a row there fails here."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "constants.md").read_text()
    raw = yaml.safe_load((bundled_profiles_dir() / f"{name}.yaml").read_text())
    for section in ("device", "intra_node", "inter_node"):
        for key in raw.get(section, {}):
            if key in ("name", "sources", "memory_bytes"):     # memory_bytes sets no time
                continue
            assert f"{section}.{key}" in doc, f"{name}: {section}.{key} is not in docs/constants.md"


def test_dgx_h100_gemm_curve_above_the_table_is_the_projects_measurement() -> None:
    """dgx-h100's two GEMM points above OpenXLA's table are the medians its source names: the
    forward, input- and weight-gradient rates of the aligned shapes of each size measured on the
    project's H100 (benchmarks/results/h100-2026-11-25/gemm_alignment.txt), over the bf16 peak."""
    import statistics
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "benchmarks/results/h100-2026-11-25/gemm_alignment.txt").read_text()
    rates = {}
    for line in text.splitlines()[1:]:
        shape, _, r = line.partition(":")
        m, k, n = map(int, shape.split())
        rates[(m, k, n)] = [float(x) * 1e12 for x in r.split()]
    aligned = {s: v for s, v in rates.items() if s[1] % 8 == 0 and s[2] % 8 == 0}
    dev = autopar.ClusterSpec.load("dgx-h100").device
    pts = sorted((p.flops, p.efficiency) for p in dev.gemm_efficiency["bf16"])
    for lo, hi, at in ((2.7e11, 2.8e11, 2.75e11), (2e12, 1e13, 2.15e12)):
        vals = [x for (m, k, n), v in aligned.items() if lo <= 2 * m * k * n <= hi for x in v]
        assert len(vals) == 12
        want = statistics.median(vals) / dev.peak_flops["bf16"]
        assert dict(pts)[at] == pytest.approx(want, abs=5e-4)
    assert pts[-1][0] == 2.15e12            # the estimate beyond the measured sizes is gone
