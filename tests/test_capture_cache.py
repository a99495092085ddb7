"""Issue 19: the capture cache returns the graph it stored, never a stale one for a changed model,
ignores a corrupt entry with a warning, and lives under the user's cache directory."""

import json
import warnings

import pytest
import torch

from autopar.capture import capture
from autopar.capture.cache import CacheWarning, CaptureCache, default_cache_dir, model_key
from autopar.models.gpt import GPT, GPTConfig

CFG = dict(vocab_size=128, seq_len=16, hidden=32, layers=2, heads=4)


def _gpt(**kw):
    with torch.device("meta"):
        return GPT(GPTConfig(**{**CFG, **kw}))


def _inputs(b=1, seq=16):
    return (torch.zeros(b, seq, dtype=torch.long, device="meta"), torch.zeros(b, seq, dtype=torch.long, device="meta"))


def test_a_warm_entry_is_the_graph_captured(tmp_path):
    cold = capture(_gpt(), _inputs(), name="tiny", cache=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1 and not list(tmp_path.glob(".*"))   # no temp file left
    warm = capture(_gpt(), _inputs(), name="tiny", cache=tmp_path)
    assert warm.capture_method == cold.capture_method + " (from the capture cache)"
    assert warm.nodes == cold.nodes and warm.params == cold.params and warm.buffers == cold.buffers
    assert (warm.layers, warm.layer_types, warm.top_modules, warm.name) == (cold.layers, cold.layer_types,
                                                                             cold.top_modules, "tiny")


def test_a_changed_model_never_hits_a_stale_entry(tmp_path):
    base = model_key(_gpt(), _inputs())
    assert model_key(_gpt(), _inputs()) == base                      # the same structure, the same key
    changed = [model_key(_gpt(hidden=64), _inputs()),                 # parameter shapes
               model_key(_gpt(layers=3), _inputs()),                  # depth
               model_key(_gpt(), _inputs(seq=8)),                     # example input shapes
               model_key(_gpt(), _inputs(), loss_fn=lambda out: out.sum())]
    m = _gpt()
    m.blocks[0].attn.heads = 8                                        # a setting no parameter shows
    changed.append(model_key(m, _inputs()))
    m = _gpt().to(torch.bfloat16)                                     # dtypes
    changed.append(model_key(m, _inputs()))
    m = _gpt()
    m.eval()                                                          # training flag (dropout)
    changed.append(model_key(m, _inputs()))
    assert len(set(changed)) == len(changed) and base not in changed
    # and through capture: the deeper model is captured anew, not read as the stored one
    g2 = capture(_gpt(), _inputs(), cache=tmp_path)
    g3 = capture(_gpt(layers=3), _inputs(), cache=tmp_path)
    assert len(g3.layers) == 3 and len(g2.layers) == 2 and "cache" not in g3.capture_method


def test_a_corrupt_entry_is_ignored_with_a_warning_and_rewritten(tmp_path):
    cold = capture(_gpt(), _inputs(), cache=tmp_path)
    entry, = tmp_path.glob("*.json")
    for bad in ("{not json", json.dumps({"format": 999}), json.dumps({"format": 1, "key": entry.stem, "graph": {}})):
        entry.write_text(bad)
        with pytest.warns(CacheWarning, match="corrupt capture cache entry"):
            g = capture(_gpt(), _inputs(), cache=tmp_path)
        assert g.nodes == cold.nodes and "cache" not in g.capture_method
        json.loads(entry.read_text())                                 # rewritten whole
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "cache" in capture(_gpt(), _inputs(), cache=tmp_path).capture_method


def test_cache_directory_follows_xdg_and_autopar_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOPAR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "autopar" / "captures"
    assert CaptureCache().directory == default_cache_dir()
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
