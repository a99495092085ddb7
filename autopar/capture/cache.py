"""The capture cache: an OpGraph on disk, keyed by the model's structure (issue 19).

Capturing a large model is most of what `autopar plan` waits for, and the same model is planned
again and again (another cluster, batch or constraint; `--compare`; a sweep). An entry is keyed
by everything the graph depends on: every module's type, settings (`extra_repr`, plain
attributes, a dataclass or Hugging Face config), training flag and the source of its class's
file; every parameter's and buffer's name, shape, dtype, `requires_grad` and tying; the example
inputs' shapes and dtypes; the loss function; torch's and transformers' versions; and autopar's
own capture code (a hash of `autopar/capture/*.py` and the Hugging Face preparation). A changed
model gets another key, never a stale entry.

Entries live in `$AUTOPAR_CACHE_DIR`, else `$XDG_CACHE_HOME/autopar/captures`, else
`~/.cache/autopar/captures`, one versioned JSON file each (`FORMAT`), written to a temporary
file and renamed into place. An entry that does not read back (truncated, another format,
edited by hand) is ignored with a warning naming it and overwritten by the new capture.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from autopar.capture.graph import OpGraph, OpNode, ParamInfo, Ref, SymDim, TensorMeta

__all__ = ["FORMAT", "CaptureCache", "CacheWarning", "cache_directory", "cached_capture", "default_cache_dir",
           "model_key"]

log = logging.getLogger(__name__)

FORMAT = 1     # the entry's JSON layout; bump it when the encoding below changes


class CacheWarning(UserWarning):
    """A capture cache entry was ignored (it did not read back) or could not be written."""


def default_cache_dir() -> Path:
    """Where captures are cached: $AUTOPAR_CACHE_DIR, else the XDG cache directory's autopar/captures."""
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        return Path(os.environ["AUTOPAR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autopar" / "captures"


# -- the key ------------------------------------------------------------------------------------

_CODE_VERSION: Optional[str] = None


def code_version() -> str:
    """autopar's version and a hash of the code a capture runs (this package, the HF preparation)."""
    global _CODE_VERSION
    if _CODE_VERSION is None:
        from autopar import __version__

        h = hashlib.sha256(__version__.encode())
        here = Path(__file__).resolve().parent
        for p in sorted(here.glob("*.py")) + [here.parent / "models" / "hf.py"]:
            if p.exists():
                h.update(p.name.encode())
                h.update(p.read_bytes())
        _CODE_VERSION = h.hexdigest()[:16]
    return _CODE_VERSION


def _source_hash(obj: Any, memo: dict) -> str:
    """A hash of the file defining `obj`'s class (or function): its forward's code changes it."""
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        path = None
    if not path:
        return "?"
    if path not in memo:
        try:
            memo[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
        except OSError:
            memo[path] = "?"
    return memo[path]


def _plain(v: Any, memo: dict) -> Any:
    """A description of a module attribute that configures it, or None to skip it (configs
    shared by many modules described once, in `memo`)."""
    if isinstance(v, (int, float, str, bool, type(None))):
        return repr(v)
    if isinstance(v, (tuple, list)) and all(isinstance(x, (int, float, str, bool, type(None))) for x in v):
        return repr(v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return repr(v)
    if hasattr(v, "to_dict") and callable(v.to_dict) and type(v).__name__.endswith("Config"):
        if id(v) not in memo:
            try:
                memo[id(v)] = json.dumps(v.to_dict(), sort_keys=True, default=repr)
            except (TypeError, ValueError):
                memo[id(v)] = repr(v)
        return memo[id(v)]
    return None


_TRANSFORMERS: list = []


def _transformers_version() -> Optional[str]:
    """The installed transformers' version (None when it is not installed), whether or not this
    process has imported it yet: a model's key is the same before and after some other model
    imported it (the local ranks of a job look up programs traced in the process they were
    forked from under the key: `runtime.shared_programs`)."""
    if not _TRANSFORMERS:
        mod = sys.modules.get("transformers")
        version = getattr(mod, "__version__", None) if mod is not None else None
        if version is None:
            from importlib import metadata

            try:
                version = metadata.version("transformers")
            except metadata.PackageNotFoundError:
                version = None
        _TRANSFORMERS.append(version)
    return _TRANSFORMERS[0]


def model_key(model: Any, example_inputs: Any, *, loss_fn: Any = None, batch_dim: bool = True,
              repeated: bool = True) -> str:
    """The cache key of capturing `model(*example_inputs)`: see the module docstring."""
    import torch

    h = hashlib.sha256()

    def put(*parts: Any) -> None:
        h.update(repr(parts).encode())
        h.update(b"\x00")

    put("autopar-capture", FORMAT, code_version(), torch.__version__, batch_dim, repeated)
    if _transformers_version() is not None:
        put("transformers", _transformers_version())
    memo: dict = {}
    for name, m in model.named_modules(remove_duplicate=False):
        attrs = sorted((k, d) for k, v in vars(m).items() if not k.startswith("_")
                       for d in [_plain(v, memo)] if d is not None)
        put("module", name, type(m).__module__, type(m).__qualname__, _source_hash(type(m), memo),
            m.training, m.extra_repr(), attrs)
    first: dict[int, str] = {}
    for kind, items in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            put(kind, name, tuple(t.shape), str(t.dtype), bool(t.requires_grad), first.setdefault(id(t), name))
    inputs = example_inputs.items() if isinstance(example_inputs, dict) else enumerate(
        example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
    for k, x in inputs:
        if isinstance(x, torch.Tensor):
            put("input", k, tuple(x.shape), str(x.dtype))
        else:
            put("input", k, type(x).__name__, repr(x))
    if loss_fn is not None:
        put("loss", getattr(loss_fn, "__module__", ""), getattr(loss_fn, "__qualname__", repr(loss_fn)),
            _source_hash(loss_fn, memo))
    return h.hexdigest()[:32]


# -- the encoding -------------------------------------------------------------------------------

class _Unencodable(TypeError):
    """A graph argument of a type the cache does not store (the graph is then not cached)."""


def _enc(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, Ref):
        return {"r": v.name}
    if isinstance(v, SymDim):
        return {"s": v.expr}
    if isinstance(v, tuple):
        return {"t": [_enc(x) for x in v]}
    if isinstance(v, list):
        return [_enc(x) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"d": {k: _enc(x) for k, x in v.items()}}
    raise _Unencodable(f"a graph argument of type {type(v).__name__}")


def _dec(v: Any) -> Any:
    if isinstance(v, list):
        return [_dec(x) for x in v]
    if isinstance(v, dict):
        (tag, x), = v.items()
        if tag == "r":
            return Ref(x)
        if tag == "s":
            return SymDim(x)
        if tag == "t":
            return tuple(_dec(y) for y in x)
        if tag == "d":
            return {k: _dec(y) for k, y in x.items()}
        raise ValueError(f"unknown tag {tag!r}")
    return v


def _meta(m: TensorMeta) -> list:
    return [_enc(tuple(m.shape)), m.dtype]


def encode(g: OpGraph) -> dict:
    """`g` as JSON-able data (raises `_Unencodable` for an argument it cannot store)."""
    nodes = [[n.name, n.kind, n.target, _enc(n.args), _enc(n.kwargs), n.inputs, [_meta(o) for o in n.outputs],
              n.flops, n.bytes_moved, n.params, n.fqn, n.module_path, n.module_type, n.layer, n.function,
              n.function_saves, n.function_work] for n in g.nodes]
    info = lambda p: [p.fqn, list(p.shape), p.dtype, p.tied, p.requires_grad]  # noqa: E731
    return {"name": g.name, "nodes": nodes, "params": [info(p) for p in g.params.values()],
            "buffers": [info(p) for p in g.buffers.values()], "layers": g.layers, "layer_types": g.layer_types,
            "top_modules": g.top_modules, "batch_size": g.batch_size, "capture_method": g.capture_method,
            "capture_time_s": g.capture_time_s, "loss_is_output": g.loss_is_output,
            "reads_positions": g.reads_positions, "own_positions": g.own_positions}


def decode(d: dict) -> OpGraph:
    """The OpGraph `encode` wrote (raises KeyError, TypeError or ValueError on other data)."""
    nodes = [OpNode(name, kind, target, args=_dec(args), kwargs=_dec(kwargs), inputs=list(inputs),
                    outputs=[TensorMeta(_dec(s), dt) for s, dt in outs], flops=float(fl), bytes_moved=float(by),
                    params=list(ps), fqn=fqn, module_path=mp, module_type=mt, layer=layer, function=fn,
                    function_saves=list(fs), function_work=float(fw))
             for name, kind, target, args, kwargs, inputs, outs, fl, by, ps, fqn, mp, mt, layer, fn, fs, fw
             in d["nodes"]]
    info = lambda r: ParamInfo(r[0], tuple(r[1]), r[2], list(r[3]), bool(r[4]))  # noqa: E731
    return OpGraph(name=d["name"], nodes=nodes, params={r[0]: info(r) for r in d["params"]},
                   buffers={r[0]: info(r) for r in d["buffers"]}, layers=list(d["layers"]),
                   layer_types=dict(d["layer_types"]), top_modules=list(d["top_modules"]),
                   batch_size=d["batch_size"], capture_method=d["capture_method"],
                   capture_time_s=float(d["capture_time_s"]), loss_is_output=bool(d["loss_is_output"]),
                   reads_positions=d.get("reads_positions"), own_positions=d.get("own_positions"))


# -- the store ----------------------------------------------------------------------------------

class CaptureCache:
    """Captured graphs on disk under `directory` (default: `default_cache_dir()`)."""

    def __init__(self, directory: Optional[Path | str] = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str) -> Optional[OpGraph]:
        """The graph stored under `key`; None when there is none or it does not read back (warned)."""
        p = self.path(key)
        try:
            text = p.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"autopar: capture cache entry {p} unreadable ({e}); capturing again",
                          CacheWarning, stacklevel=3)
            return None
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT or d.get("key") != key:
                raise ValueError(f"format {d.get('format')!r}, key {d.get('key')!r}")
            return decode(d["graph"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            warnings.warn(f"autopar: ignoring corrupt capture cache entry {p} ({type(e).__name__}: "
                          f"{str(e)[:120]}); capturing again", CacheWarning, stacklevel=3)
            return None

    def put(self, key: str, g: OpGraph) -> Optional[Path]:
        """Store `g` under `key` atomically (a temporary file renamed into place); None, with a
        warning, when it cannot be written."""
        try:
            data = {"format": FORMAT, "key": key, "graph": encode(g)}
        except _Unencodable as e:
            log.info("capture of %s not cached: %s", g.name, e)
            return None
        p = self.path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(data, separators=(",", ":")))   # dumps: C encoder; dump streams in Python
                os.replace(tmp, p)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as e:
            warnings.warn(f"autopar: cannot write the capture cache under {self.directory} ({e}); "
                          f"continuing without it", CacheWarning, stacklevel=3)
            return None
        return p


def cache_directory(cache: Any) -> Optional[Path]:
    """The directory a `cache` argument names (True: the default one; a directory; a
    CaptureCache), or None for no cache (None, False)."""
    if isinstance(cache, CaptureCache):
        return cache.directory
    if cache is True:
        return default_cache_dir()
    if isinstance(cache, (str, Path)):
        return Path(cache)
    return None


def cached_capture(model: Any, example_inputs: Sequence[Any], *, cache: Any = True, loss_fn: Any = None,
                   name: Optional[str] = None, batch_dim: bool = True, repeated: bool = True) -> OpGraph:
    """`capture` through the cache: the stored graph of a model of the same structure, else a
    new capture, stored. `cache`: a CaptureCache, a directory, or True for the default one."""
    from autopar.capture.export import _prepare_hf, capture

    store = cache if isinstance(cache, CaptureCache) else CaptureCache(None if cache is True else cache)
    t0 = time.perf_counter()
    _prepare_hf(model)      # what capture changes of a Hugging Face config, before the key reads it
    key = model_key(model, example_inputs, loss_fn=loss_fn, batch_dim=batch_dim, repeated=repeated)
    g = store.get(key)
    if g is not None:
        g.name = name or type(model).__name__
        g.capture_method += " (from the capture cache)"
        g.capture_time_s = time.perf_counter() - t0
        return g
    g = capture(model, example_inputs, loss_fn=loss_fn, name=name, batch_dim=batch_dim, repeated=repeated)
    store.put(key, g)
    return g
