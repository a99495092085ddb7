"""The CLI as a user runs it: output, exit codes, one-line errors, no half-written files."""

import json
import os
import subprocess
import sys

import pytest

from autopar.schema.plan import PLAN_FORMAT_VERSION

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ENV.pop("AUTOPAR_DEBUG", None)


def autopar(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=300)


def test_plan_prints_and_writes(tmp_path):
    out = tmp_path / "plan.json"
    r = autopar("plan", "--model", "gpt-tiny", "--cluster", "cpu", "--global-batch-size", "8",
                "--dtype", "fp32", "-o", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "predicted:" in r.stdout and "stage" in r.stdout
    plan = json.loads(out.read_text())
    assert plan["global_batch_size"] == 8
    assert sorted({d for st in plan["stages"] for d in st["devices"]}) == [0, 1]   # both processes used
    s = autopar("show", str(out))
    assert s.returncode == 0 and "gpt-tiny" in s.stdout
    j = autopar("show", str(out), "--json")
    assert json.loads(j.stdout) == plan


def test_models_and_schema():
    r = autopar("models")
    assert r.returncode == 0 and "gpt3-175b" in r.stdout and "mlp" in r.stdout
    s = autopar("schema")
    assert s.returncode == 0 and json.loads(s.stdout)["title"] == "Plan"


@pytest.mark.parametrize("args, message", [
    (["plan", "--model", "gpt-nope", "--cluster", "cpu", "-b", "8"], "unknown model 'gpt-nope'"),
    (["plan", "--model", "no_such_mod:factory", "--cluster", "cpu", "-b", "8"], "cannot import module"),
    (["plan", "--model", "gpt-tiny", "--cluster", "dgx-z9", "-b", "8"], "unknown cluster 'dgx-z9'"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "-b", "0"], "--global-batch-size must be >= 1"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "-b", "7", "--dp", "2"], "divide"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "-b", "8", "--zero-stage", "5"], "zero_stage"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "-b", "8", "--dp", "3", "--tp", "1", "--pp", "1"],
     "dp"),
    (["plan", "--model", "gpt-tiny", "--cluster", "dgx-a100-80g", "-b", "8", "--pp", "8"],
     "pp=8 stages need at least 8 layers; the model has 4 layer slots (2 repeated blocks"),
    # (tp beyond the heads plans under ZeRO-3 too now: the executor runs it as solved)
    (["plan", "--model", "gpt-tiny", "--cluster", "dgx-a100-80g", "--nodes", "2", "-b", "16", "--tp", "3"],
     "tp=3 does not divide the cluster's 16 devices"),
    (["plan", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "-b", "8"], "least memory any plan needs is"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--nodes", "2", "-b", "8"], "needs an inter_node link"),
    (["show", "missing-plan.json"], "does not exist"),
    (["plan", "--cluster", "cpu", "-b", "8"], "Missing option '--model'"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    out = tmp_path / "out.json"
    r = autopar(*args, "-o", str(out)) if args[0] == "plan" else autopar(*args, cwd=tmp_path)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists() and not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_bad_plan_files(tmp_path):
    good = tmp_path / "good.json"
    assert autopar("plan", "--model", "gpt-tiny", "--cluster", "cpu", "-b", "8", "-o", str(good), "-q").returncode == 0
    text = good.read_text()
    (tmp_path / "trunc.json").write_text(text[: len(text) // 2])
    d = json.loads(text)
    d["format_version"] = PLAN_FORMAT_VERSION + 1
    (tmp_path / "future.json").write_text(json.dumps(d))
    for name, msg in (("trunc.json", "not valid JSON"), ("future.json", "newer than this autopar")):
        r = autopar("show", str(tmp_path / name))
        assert r.returncode == 1 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_invalid_cluster_file(tmp_path):
    f = tmp_path / "mycluster.yaml"
    f.write_text("num_nodes: 1\ndevices_per_node: 8\ndevice: {name: x, peak_flops: {bf16: 1.0e14}, "
                 "memory_bytes: -5, memory_bandwidth: 1.0e12}\nintra_node: {bandwidth: 1.0e11, latency: 1.0e-6}\n")
    r = autopar("plan", "--model", "gpt-tiny", "--cluster", str(f), "-b", "8")
    assert r.returncode == 1 and "field 'device.memory_bytes'" in r.stderr


def test_run_with_another_model_is_refused(tmp_path):
    plan = tmp_path / "plan.json"
    assert autopar("plan", "--model", "gpt-tiny", "--cluster", "cpu", "-b", "8", "-o", str(plan), "-q").returncode == 0
    metrics = tmp_path / "m.jsonl"
    r = autopar("run", str(plan), "--model", "gpt-small", "--steps", "1", "--metrics", str(metrics))
    assert (r.returncode == 1 and "plan was made for gpt-tiny" in r.stderr
            and "re-plan with --model gpt-small" in r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and not metrics.exists()


def test_factory_module_beside_the_user_resolves(tmp_path):
    (tmp_path / "mynet.py").write_text(
        "import torch, torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.conv = nn.Conv2d(3, 8, 3, padding=1); self.fc = nn.Linear(8, 4)\n"
        "    def forward(self, x, y):\n"
        "        h = torch.relu(self.conv(x)).mean((2, 3))\n"
        "        return nn.functional.cross_entropy(self.fc(h), y)\n"
        "def build():\n"
        "    return Net(), (torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2,)))\n")
    r = autopar("plan", "--model", "mynet:build", "--cluster", "cpu", "-b", "8", "--dtype", "fp32", "-q",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "autopar plan for mynet:build" in r.stdout


def test_help_and_models_import_neither_torch_nor_the_solvers():
    """Issue 19: `autopar --help` and `autopar models` answer without loading torch, torch.distributed
    or OR-Tools (they took ~1.4 s when they did)."""
    code = ("import sys; from autopar.cli import main\n"
            "for argv in (['--help'], ['models'], ['plan', '--help']):\n"
            "    assert main(argv) == 0\n"
            "heavy = [m for m in ('torch', 'torch.distributed', 'ortools', 'networkx') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout and "gpt3-175b" in r.stdout and "--no-cache" in r.stdout


def test_plan_uses_the_capture_cache_unless_no_cache(tmp_path, monkeypatch, capsys):
    """`autopar plan` stores the capture under $XDG_CACHE_HOME/autopar/captures and reads it back
    (the plan says so); `--no-cache` neither reads nor writes it, and plans the same."""
    from autopar.cli import main

    monkeypatch.delenv("AUTOPAR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = tmp_path / "cache" / "autopar" / "captures"
    args = ["plan", "--model", "gpt-tiny", "--cluster", "cpu", "-b", "8", "--dtype", "fp32", "--quiet", "--json"]
    assert main([*args, "--no-cache"]) == 0
    fresh = json.loads(capsys.readouterr().out)
    assert not store.exists()
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(list(store.glob("*.json"))) == 1 and "cache" not in first["search"]["capture"]
    assert main(args) == 0
    warm = json.loads(capsys.readouterr().out)
    assert warm["search"]["capture"].endswith("(from the capture cache)")
    for p in (first, warm):
        assert {k: v for k, v in p.items() if k != "search"} == {k: v for k, v in fresh.items() if k != "search"}
