"""Capture a stack of identical blocks once and stitch it to the model's depth (issue 19).

torch.export's time grows with depth: a 96-block GPT-3 175B takes ~6 s where its first three
blocks take ~0.5 s (most of it fixed: each export's first block, the rest a tenth of that
each). A model whose repeated blocks are one stack of identical modules (same class, parameter
shapes and dtypes, settings; no tensor shared between blocks) is exported with the stack cut to
its first 3 blocks, and the whole graph is written from that: block i's ops are the third
block's, renamed, and the ops after the stack are the cut model's.

The result must be the graph a whole export gives, node names included (a plan names ops by
them and the runtime matches them against its own export of the whole model): torch.fx names a
node `base_n`, n counting the nodes of that base made before it, so every block shifts each name
by a fixed step, read off block 2 against block 1; the ops after the stack shift by what one
block adds: the nodes of their base in the third block's span of the exported graph, where the
graph's names of that base count on by one through blocks 1 and 2 (no node of it dropped or
renamed there after it was named: then counting them is counting what the namer counted).
While the cut model is exported its stack reports what its forward asks of it (`_Watch`): one
pass over its blocks tells the forward nothing of their number, so the ops before and after the
stack are the whole model's (a slice stopping before the last block, a model running fewer
blocks than it holds, is refused). Where one cut does not show enough (the forward reads
`len()` or a negative index, goes over the blocks twice, a name's count skips), the model cut
to 2 blocks is exported too and
the two cuts are compared as before: the ops before the stack must be the same in both, the ops
after it the same read one block later, and their names' step is read off the pair. Anything
neither shows consistently (an op before the stack that changed, a block reading two blocks
back, a name whose step differs) leaves `stitched` returning the reason, and `capture` exports
the whole model and records that reason in `OpGraph.capture_method`.
`tests/test_capture_repeated.py` checks the stitched graph equals the whole export on the zoo
and Hugging Face families, and on models that read their number of blocks.

What the cuts cannot show: a forward that treats blocks past the third differently by their
index alone (`if i == 40:` in the model's loop, not a setting of the block's modules), or that
learns their number other than from the stack (counting the model's parameters, keeping the
loop's last index past it); such a model needs `capture(..., repeated=False)`.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter, OrderedDict
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional

import torch.nn as nn

from autopar.capture.graph import OpNode, ParamInfo, Ref, map_nested

__all__ = ["Stack", "find_stack", "stitched"]

log = logging.getLogger(__name__)

MIN_BLOCKS = 5     # fewer: the cut exports cost about what the whole one does

_SUFFIX = re.compile(r"^(.*)_(\d+)$")

Raw = tuple[list[OpNode], dict[str, ParamInfo], dict[str, ParamInfo]]
# a cut's raw capture and the names of its exported graph's nodes, in the graph's order
Exported = tuple[Raw, list[str]]


class Stack:
    """A container of identical blocks: its FQN (as the model names it), its module and the
    number of blocks."""

    def __init__(self, fqn: str, module: nn.Module) -> None:
        self.fqn = fqn
        self.module = module
        self.n = len(module._modules)

    def prefix(self, i: int, root: str = "") -> str:
        """FQN prefix of block `i` (under `root`, the wrapper's name for the model)."""
        return ".".join(x for x in (root, self.fqn, str(i)) if x) + "."


def _settings(m: nn.Module) -> tuple:
    """What configures a module beyond its parameters: its repr line and plain attributes."""
    plain = tuple(sorted((k, v) for k, v in vars(m).items()
                         if not k.startswith("_") and isinstance(v, (int, float, str, bool, tuple, type(None)))))
    return type(m).__qualname__, m.extra_repr(), plain


def _structure(block: nn.Module, index_keys: frozenset = frozenset()) -> tuple:
    """A block's modules, settings, parameters and buffers; the attributes in `index_keys`
    ((module, attribute) holding the block's own index, Hugging Face's `layer_idx`) left out."""
    mods = tuple((n, (q, r, tuple((k, repr(v)) for k, v in plain if (n, k) not in index_keys)))
                 for n, m in block.named_modules() for q, r, plain in [_settings(m)])
    return (mods,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in block.named_parameters(remove_duplicate=False)),
            tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers(remove_duplicate=False)))


def _index_keys(blocks: list[nn.Module]) -> frozenset:
    """(module, attribute) pairs whose integer value is the block's index in every block."""
    keys = None
    for i, b in enumerate(blocks):
        here = {(n, k) for n, m in b.named_modules() for k, v in _settings(m)[2] if type(v) is int and v == i}
        keys = here if keys is None else keys & here
    return frozenset(keys or ())


def find_stack(model: nn.Module, layers: list[str]) -> tuple[Optional[Stack], str]:
    """The one container holding all of `layers` (`export.find_layers`) as identical blocks
    "0".."n-1", or (None, why not)."""
    if not layers:
        return None, "no repeated blocks"
    parents = {l.rsplit(".", 1)[0] if "." in l else "" for l in layers}
    if len(parents) != 1:
        return None, "repeated blocks in more than one container"
    fqn = parents.pop()
    container = model.get_submodule(fqn) if fqn else model
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or not fqn:
        return None, "the repeated blocks are not held by a ModuleList or Sequential"
    keys = list(container._modules)
    if keys != [str(i) for i in range(len(keys))] or [f"{fqn}.{k}" for k in keys] != layers:
        return None, "the container holds other modules beside the repeated blocks"
    if len(keys) < MIN_BLOCKS:
        return None, f"{len(keys)} blocks (stitching pays from {MIN_BLOCKS})"
    blocks = list(container._modules.values())
    idx = _index_keys(blocks)
    ref = _structure(blocks[0], idx)
    if any(_structure(b, idx) != ref for b in blocks[1:]):
        return None, "the blocks differ in structure"
    seen: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for t in [*b.parameters(), *b.buffers()]:
            if seen.setdefault(id(t), i) != i:
                return None, "blocks share a parameter or buffer"
    inside = set(seen)
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    outside = [t for n, t in named if not n.startswith(fqn + ".")]
    if any(id(t) in inside for t in outside):
        return None, "a block's parameter is tied to one outside the blocks"
    types = getattr(getattr(model, "config", None), "layer_types", None)
    if isinstance(types, (list, tuple)) and len(set(types)) > 1:
        return None, "the blocks differ by configuration (config.layer_types)"
    return Stack(fqn, container), ""


@contextlib.contextmanager
def cut_to(stack: Stack, k: int) -> Iterator[None]:
    """The model with `stack` cut to its first `k` blocks, inside the block."""
    full = stack.module._modules
    stack.module._modules = OrderedDict(list(full.items())[:k])
    try:
        yield
    finally:
        stack.module._modules = full


def stitched(stack: Stack, export_raw: Callable[[], Exported]) -> tuple[Optional[Raw], str]:
    """The whole model's raw capture (nodes, parameters, buffers) from an export of the model
    with `stack` cut to 3 blocks, and one cut to 2 where that is not enough (`export_raw`
    exports the model as it is at the call), or (None, why not)."""
    full = stack.module._modules
    watch = _Watch(stack)
    try:
        stack.module._modules = OrderedDict(list(full.items())[:3])
        with watch:
            raw3, names3 = export_raw()
        if watch.refuse:
            return None, watch.refuse
        unsure = watch.why
        if not unsure:
            try:
                return _stitch_or_refuse(stack, None, raw3, names3), ""
            except _Unsure as e:
                unsure = str(e)
            except _Refused as e:
                return None, str(e)
        log.debug("one cut of %s does not show enough (%s): exporting it cut to 2 blocks too", stack.fqn, unsure)
        stack.module._modules = OrderedDict(list(full.items())[:2])
        raw2, _ = export_raw()
    finally:
        stack.module._modules = full
    return _stitch(stack, raw2, raw3)


class _Watch:
    """While the cut model is exported, its stack notes what its forward asks of it beyond one
    pass over its blocks in order (`why`: empty when nothing): its length, a negative index, a
    slice other than from the first block to (at least) the last, a second pass, a membership
    test; and in `refuse`, a slice that stops before the last block (the model runs fewer
    blocks than it holds: no cut stitches that). The stack's class is swapped for a subclass
    that notes them, for the export only."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.why = ""
        self.refuse = ""          # what no cut can stitch
        self.passes = 0

    def note(self, why: str) -> None:
        self.why = self.why or why

    def __enter__(self) -> "_Watch":
        base = type(self.stack.module)
        watch, n = self, self.stack.n

        class Watched(base):  # type: ignore[misc, valid-type]
            def __len__(self) -> int:
                watch.note("the forward reads the number of blocks")
                return super().__len__()

            def __iter__(self):  # noqa: ANN204
                watch.passes += 1
                if watch.passes > 1:
                    watch.note("the forward goes over the blocks more than once")
                return super().__iter__()

            def __reversed__(self):  # noqa: ANN204
                watch.note("the forward goes over the blocks backwards")
                return super().__reversed__()

            def __contains__(self, x: Any) -> bool:
                watch.note("the forward asks whether a module is a block")
                return super().__contains__(x)

            def __getitem__(self, idx: Any) -> Any:
                if isinstance(idx, slice):
                    start, stop, step = idx.start, idx.stop, idx.step
                    if isinstance(stop, int) and 0 <= stop < n and start in (None, 0) and step in (None, 1):
                        # runs the first `stop` blocks: cut to 3 it runs 3 of them
                        watch.refuse = watch.refuse or f"the forward runs {stop} of the {n} blocks"
                    elif start not in (None, 0) or step not in (None, 1) or not (stop is None or
                                                                                (isinstance(stop, int) and stop >= n)):
                        watch.note(f"the forward takes a slice {idx} of the blocks")
                elif not (isinstance(idx, int) and idx >= 0):
                    watch.note(f"the forward reads block [{idx}]")
                self.__class__ = base       # a slice is built by the container's own methods
                try:
                    out = base.__getitem__(self, idx)
                finally:
                    self.__class__ = Watched
                if type(out) is base:       # ... and watched like the stack (all its blocks)
                    out.__class__ = Watched
                return out

        Watched.__name__, Watched.__qualname__, Watched.__module__ = base.__name__, base.__qualname__, base.__module__
        self.base = base
        self.stack.module.__class__ = Watched
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.module.__class__ = self.base


# -- names ------------------------------------------------------------------------------------

def _parts(name: str) -> list[tuple[str, int]]:
    """`name` as (base, n) per `__`-separated part (an inlined subgraph's op is `outer__inner`)."""
    out = []
    for p in name.split("__"):
        m = _SUFFIX.match(p)
        out.append((m.group(1), int(m.group(2))) if m else (p, 0))
    return out


def _join(parts: list[tuple[str, int]]) -> str:
    return "__".join(f"{b}_{n}" if n else b for b, n in parts)


def _step(a: str, b: str) -> Optional[tuple[int, ...]]:
    """The per-part count step from name `a` to name `b`, None when their bases differ."""
    pa, pb = _parts(a), _parts(b)
    if len(pa) != len(pb) or any(x[0] != y[0] for x, y in zip(pa, pb)):
        return None
    return tuple(y[1] - x[1] for x, y in zip(pa, pb))


def _shift(name: str, step: tuple[int, ...], times: int) -> str:
    return _join([(b, n + s * times) for (b, n), s in zip(_parts(name), step)])


def _sanitize(s: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", s)


# -- stitching --------------------------------------------------------------------------------

class _Cut:
    """One cut capture split into placeholders, the ops before the stack, one op list per
    block (from its first op to the next block's first; the last block as long as the one
    before it) and the ops after."""

    def __init__(self, raw: Raw, stack: Stack, k: int) -> None:
        self.nodes, self.params, self.buffers = raw
        self.holders = [n for n in self.nodes if n.kind not in ("call", "output")]
        calls = [n for n in self.nodes if n.kind == "call"]
        self.output = next(n for n in self.nodes if n.kind == "output")
        starts = []
        for i in range(k):
            pre = stack.prefix(i)[:-1]
            at = next((x for x, n in enumerate(calls)
                       if n.module_path == pre or n.module_path.startswith(pre + ".")), None)
            if at is None:
                raise _Refused(f"block {i} of the cut model has no op")
            starts.append(at)
        if starts != sorted(starts):
            raise _Refused("the blocks do not run in order")
        self.pre = calls[:starts[0]]
        self.blocks = [calls[a:b] for a, b in zip(starts, starts[1:])]
        last = calls[starts[-1]:starts[-1] + len(self.blocks[-1])]
        self.blocks.append(last)
        self.post = calls[starts[-1] + len(last):]


class _Refused(Exception):
    """Why a model's capture cannot be stitched (the whole model is exported instead)."""


class _Unsure(_Refused):
    """Why one cut does not show enough to stitch (the model cut to 2 blocks is exported too)."""


def _same_op(a: OpNode, b: OpNode, rename: Callable[[str], str]) -> bool:
    return (a.kind == b.kind and a.target == b.target and a.outputs == b.outputs
            and a.module_type == b.module_type and [rename(x) for x in a.inputs] == b.inputs
            and _renamed(a.args, rename) == b.args and _renamed(a.kwargs, rename) == b.kwargs)


def _renamed(v: Any, rename: Callable[[str], str]) -> Any:
    return map_nested(v, Ref, lambda r: Ref(rename(r.name)))


def _moved_path(path: str, src: str, dst: str) -> str:
    """Module path `path` under block prefix `src` ("blocks.2.") moved under `dst`."""
    if path == src[:-1]:
        return dst[:-1]
    return dst + path[len(src):] if path.startswith(src) else path


def _base(name: str) -> tuple[str, int]:
    """A top-level node name as torch.fx's namer made it: (base, count), `add_3` -> ("add", 3)."""
    m = _SUFFIX.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _post_steps(b: _Cut, steps: list[tuple[int, ...]], names: list[str]) -> list[tuple[int, ...]]:
    """The count step per block of each op after the blocks, from the 3-block cut alone: the
    nodes of the op's base in block 2's span of the exported graph (`names`, in order; from
    block 2's first op to the first op after the blocks). That is what one more block adds to
    the op's count where torch.fx counted every node of the base in the graph's order and none
    was renamed or dropped since: through blocks 1 and 2 the graph's names of each base an op
    after the blocks has count on by one (else `_Unsure`; before them a count may be skipped,
    a dropped node of the ops before the blocks, the same in every cut, and other bases may
    skip, a dropped `sym_size_int` say, which no name stepped here counts); and block 1's span
    holds the same bases as block 2's (every block adds alike)."""
    for op in b.post:
        if "__" in op.name:
            raise _Unsure(f"an op after the blocks has an inlined name ({op.name})")
    bases = {_base(op.name)[0] for op in b.post}
    pos = {nm: i for i, nm in enumerate(names)}
    t1, t2 = b.blocks[1], b.blocks[2]
    end = b.post[0].name if b.post else b.output.name
    if any(x not in pos for x in (t1[0].name, t2[0].name, end)):
        raise _Unsure("the blocks' ops are not nodes of the exported graph")
    # blocks 1 and 2 drop no name of those bases: each counts on from the one before it
    last: dict[str, int] = {}
    for x, nm in enumerate(names[:pos[end]]):
        base, k = _base(nm)
        if base in bases:
            if x >= pos[t1[0].name] and k != last.get(base, -1) + 1:
                raise _Unsure(f"the exported graph's names of {base} skip a count ({nm})")
            last[base] = k
    span1 = Counter(_base(nm)[0] for nm in names[pos[t1[0].name]:pos[t2[0].name]])
    span2 = Counter(_base(nm)[0] for nm in names[pos[t2[0].name]:pos[end]])
    if span1 != span2:
        raise _Unsure("blocks 1 and 2 add different nodes to the exported graph")
    for x, s in zip(t2, steps):     # the template's own steps are the same counts
        base = _parts(x.name)[0][0]
        if base in bases and s[0] != span2[base]:
            raise _Unsure(f"op {x.name}'s step is not what its block adds")
    return [(span2[_base(op.name)[0]],) for op in b.post]


def _stitch(stack: Stack, raw2: Raw, raw3: Raw) -> tuple[Optional[Raw], str]:
    try:
        return _stitch_or_refuse(stack, raw2, raw3), ""
    except _Refused as e:
        return None, str(e)


def _stitch_or_refuse(stack: Stack, raw2: Optional[Raw], raw3: Raw, names3: Optional[list[str]] = None) -> Raw:
    """The whole model's raw capture from the cuts to 2 and 3 blocks; with `raw2` None, from
    the cut to 3 alone and its exported graph's node names `names3` (raises `_Unsure` where
    they do not show the names' steps)."""
    a, b = (_Cut(raw2, stack, 2) if raw2 is not None else None), _Cut(raw3, stack, 3)
    n = stack.n
    # module paths and FQNs are the model's; placeholder names are the wrapper's ("p_model_...")
    mp = [stack.prefix(i) for i in range(n)]
    same = lambda x: x  # noqa: E731
    if [len(s) for s in b.blocks] != [len(b.blocks[0])] * 3:
        raise _Refused("the blocks' op counts differ")
    t1, t2 = b.blocks[1], b.blocks[2]
    if a is not None:
        if len(a.pre) != len(b.pre) or any(x.name != y.name or not _same_op(x, y, same)
                                           for x, y in zip(a.pre, b.pre)):
            raise _Refused("the ops before the blocks depend on their number")
        if [len(s) for s in a.blocks] != [len(b.blocks[0])] * 2:
            raise _Refused("the blocks' op counts differ")
        if len(a.post) != len(b.post):
            raise _Refused("the ops after the blocks depend on their number")
        if any(x.name != y.name for x, y in zip(a.blocks[1], t1)):
            raise _Refused("block 1's names depend on the blocks after it")

    # placeholders of block 2 (the template) and the name each takes in block i
    def holder_for(h: OpNode, i: int) -> tuple[str, str]:
        src_fq, src_name = mp[2], _sanitize(stack.prefix(2, "model"))
        dst_fq, dst_name = mp[i], _sanitize(stack.prefix(i, "model"))
        if not (h.fqn or "").startswith(src_fq) or src_name not in h.name:
            raise _Refused(f"cannot rename placeholder {h.name}")
        return h.name.replace(src_name, dst_name, 1), dst_fq + h.fqn[len(src_fq):]

    in_block = lambda h, i: (h.fqn or "").startswith(mp[i])  # noqa: E731
    tmpl_holders = [h for h in b.holders if in_block(h, 2)]
    for h1, h2 in zip([h for h in b.holders if in_block(h, 1)], tmpl_holders):
        if holder_for(h2, 1) != (h1.name, h1.fqn):
            raise _Refused("block parameters are not named by their block's index")

    # the count step of every template op's name, block 1 -> block 2
    steps = []
    for x, y in zip(t1, t2):
        s = _step(x.name, y.name)
        if s is None:
            raise _Refused(f"ops {x.name} and {y.name} of blocks 1 and 2 differ")
        steps.append(s)
    holder2 = {h.name: h for h in tmpl_holders}
    names2 = {y.name: x for x, y in enumerate(t2)}
    names1 = {x.name: k for k, x in enumerate(t1)}
    names0 = {x.name for x in b.blocks[0]}

    def block_name(x: int, i: int) -> str:
        return _shift(t2[x].name, steps[x], i - 2)

    def rename_in(i: int) -> Callable[[str], str]:
        """Names read by block 2's ops -> those block i reads."""
        def f(nm: str) -> str:
            if nm in names2:
                return block_name(names2[nm], i)
            if nm in names1:
                return block_name(names1[nm], i - 1)
            if nm in holder2:
                return holder_for(holder2[nm], i)[0]
            if nm in names0:
                raise _Refused(f"block 2 reads {nm} of block 0")
            return nm
        return f

    # block 2 as block 1 would be written from block 2's names: the template must reproduce it
    r1 = rename_in(1)
    for x, y in zip(t2, t1):
        if block_name(names2[x.name], 1) != y.name or not _same_op(x, y, r1) or \
                _moved_path(x.module_path, mp[2], mp[1]) != y.module_path:
            raise _Refused(f"block 1's op {y.name} is not block 2's {x.name} renamed")

    # the ops after the blocks: the 3-block cut's, names stepped by what each block adds
    if a is None:
        post_steps = _post_steps(b, steps, names3 or [])
    else:
        post_steps = []
        for x, y in zip(a.post, b.post):
            s = _step(x.name, y.name)
            if s is None or x.target != y.target or x.outputs != y.outputs:
                raise _Refused("the ops after the blocks differ between the cuts")
            post_steps.append(s)
    post_names = {y.name: _shift(y.name, s, n - 3) for y, s in zip(b.post, post_steps)}
    last = rename_in(n - 1)

    def rename_post(nm: str) -> str:
        if nm in post_names:
            return post_names[nm]
        if nm in names1 or nm in names0 or nm in holder2:
            raise _Refused(f"an op after the blocks reads {nm} of a block before the last")
        return last(nm)

    # the ops after the blocks in the 2-block cut: the 3-block cut's, read one block earlier
    if a is not None:
        a_of = {y.name: x.name for x, y in zip(a.post, b.post)}
        a_of.update({y.name: x.name for x, y in zip(a.blocks[1], t2)})
        for x, y in zip(a.post, b.post):
            if not _same_op(y, x, lambda nm: a_of.get(nm, nm)):
                raise _Refused(f"the op after the blocks {y.name} differs between the cuts")

    # write the whole graph; parameters lead buffers in the export's placeholders: a block's
    # parameters follow the last parameter of block 2, its buffers its last buffer
    holders = list(b.holders)
    template_of: dict[str, str] = {}
    extra = []
    for i in range(3, n):
        for h in tmpl_holders:
            nm, fq = holder_for(h, i)
            template_of[fq] = h.fqn
            extra.append(replace(h, name=nm, fqn=fq))
    last_p = max((x for x, h in enumerate(holders) if in_block(h, 2) and h.kind == "param"), default=None)
    last_b = max((x for x, h in enumerate(holders) if in_block(h, 2) and h.kind != "param"), default=None)
    out: list[OpNode] = []
    for x, h in enumerate(holders):
        out.append(h)
        if x == last_p:
            out.extend(h2 for h2 in extra if h2.kind == "param")
        if x == last_b:
            out.extend(h2 for h2 in extra if h2.kind != "param")
    out.extend(b.pre)
    out.extend(b.blocks[0])
    out.extend(b.blocks[1])
    out.extend(t2)
    for i in range(3, n):
        ren = rename_in(i)
        for x, op in enumerate(t2):
            out.append(replace(
                op, name=block_name(x, i), args=_renamed(op.args, ren), kwargs=_renamed(op.kwargs, ren),
                inputs=[ren(v) for v in op.inputs], outputs=list(op.outputs),
                function_saves=[ren(v) for v in op.function_saves],
                params=[mp[i] + p[len(mp[2]):] if p.startswith(mp[2]) else p for p in op.params],
                module_path=_moved_path(op.module_path, mp[2], mp[i])))
    for op in b.post:
        out.append(replace(op, name=post_names[op.name], args=_renamed(op.args, rename_post),
                           kwargs=_renamed(op.kwargs, rename_post), inputs=[rename_post(v) for v in op.inputs],
                           function_saves=[rename_post(v) for v in op.function_saves]))
    out.append(replace(b.output, inputs=[rename_post(v) for v in b.output.inputs],
                       args=_renamed(b.output.args, rename_post)))

    def grown(table: dict[str, ParamInfo], kinds: set[str]) -> dict[str, ParamInfo]:
        res: dict[str, ParamInfo] = {}
        for h in out:
            if h.kind in kinds:
                fq = h.fqn or ""
                res[fq] = table[fq] if fq in table else replace(table[template_of[fq]], fqn=fq, tied=[])
        for fq, info in table.items():        # anything no placeholder names, as captured
            res.setdefault(fq, info)
        return res

    return out, grown(b.params, {"param"}), grown(b.buffers, {"buffer"})
