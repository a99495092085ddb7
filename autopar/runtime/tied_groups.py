"""Parameters held by more than one pipeline stage (`ParallelModel`'s mixin): which, in which
layouts, and the groups their gradients are summed over (`tied_grads`)."""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist
import torch.nn as nn

from autopar.runtime.meshes import _mesh_kinds, fsdp_sharded
from autopar.runtime.pipeline_p2p import replica_ranks
from autopar.runtime.tied_grads import FlatTiedSync, FullTiedSync, LocalTiedSum, TiedEntry, check_agreement
from autopar.runtime.validate import stage_parameters
from autopar.schema.plan import StagePlan


class TiedParameters:
    """The tied-parameter part of `engine.ParallelModel` (its attributes are the engine's)."""

    def _build_tied_groups(self) -> None:
        """Parameters held by more than one chunk: their gradients are summed over a group
        joining the copies (`tied_grads`): one per mesh coordinate when the holders hold them in
        one layout (equal meshes and placements), else one per data-parallel replica over all
        the holders' ranks (one over all replicas under ZeRO-3, whose replicas hold different
        shards). A rank holding several copies (several of its chunks read the parameter: any
        schedule with more than one chunk per rank) sums them first; copies on one device set
        only are summed on the rank, no collective. Every group's ranks are checked to lay out
        the same flat buffer (`_check_tied_agreement`) before any step runs."""
        self.tied: list[LocalTiedSum | FlatTiedSync | FullTiedSync] = []
        self.checkpoint_skip: set[str] = set()
        if self.pp == 1:
            return
        mine: list[tuple[int, list[int], list[tuple[str, int]]]] = []
        crossing = False
        for k, (dss, names) in enumerate(self._tied_sets().items()):
            if len(dss) == 1:
                if self.rank in self.devsets[dss[0]]:
                    summed = LocalTiedSum(self._local_copies(names))
                    if summed.entries:
                        self.tied.append(summed)
                continue
            crossing = True
            if self._same_layout(dss, names):
                groups = [[self.devsets[d][c] for d in dss] for c in range(len(self.devsets[dss[0]]))]
                sync = FlatTiedSync
            else:
                groups = self._full_tied_groups(dss)
                sync = FullTiedSync
                self._mark_checkpoint_skip(dss, names)
            for ranks in groups:
                g = dist.new_group(ranks)
                if self.rank in ranks:
                    extra = {}
                    if sync is FullTiedSync and len(groups) == 1 and not self.zero3:
                        # one group over every dp replica (a ZeRO-3 holder): this stage's
                        # copy is the same dp-averaged tensor on each replica; count it once
                        extra["adds"] = self.dp_rank == 0
                    t = sync(g, self._local_copies(names), ranks=ranks, **extra)
                    self.tied.append(t)
                    mine.append((k, list(ranks), t.signature()))
        if crossing:
            self._check_tied_agreement(mine)

    def _check_tied_agreement(self, mine: list[tuple[int, list[int], list[tuple[str, int]]]]) -> None:
        """One all-gather of every rank's tied groups and flat-buffer layouts (names, elements),
        at setup: a group whose ranks would all-reduce buffers of different sizes (a hang, or
        gloo aborting every process) is a PlanError naming the weight and the ranks. Skipped on
        a fake process group (`autopar verify`), where nothing travels."""
        if dist.get_backend() == "fake":
            return
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine)
        check_agreement(self.rank, mine, everyone)

    def _tied_sets(self) -> dict[tuple[int, ...], list[str]]:
        """{device-set indices holding them (sorted): canonical names} of the parameters held by
        more than one chunk, on several device sets or on one (several chunks of one rank)."""
        holders: dict[str, set[int]] = {}
        chunks: dict[str, int] = {}
        for si in range(len(self.stages)):
            for canon in self._stage_params(si):
                holders.setdefault(canon, set()).add(si % self.pp)
                chunks[canon] = chunks.get(canon, 0) + 1
        bykey: dict[tuple[int, ...], list[str]] = {}
        for k in sorted(holders):
            if chunks[k] > 1:
                bykey.setdefault(tuple(sorted(holders[k])), []).append(k)
        return bykey

    def _same_layout(self, dss: Sequence[int], names: Sequence[str]) -> bool:
        """Whether the device sets `dss` hold the parameters `names` in one layout: equal stage
        meshes and, for each parameter, equal placements in every holding stage (rank c of each
        then holds the same elements). A planner may place a tied embedding replicated on one
        stage and vocabulary-sharded on another of the same mesh."""
        if len(_mesh_kinds([self.stages[d] for d in dss])) != 1:
            return False
        return all(len({self._placement_of(s, n) for s in self._holders(dss, n)}) == 1 for n in names)

    def _holders(self, dss: Sequence[int], canon: str) -> list[StagePlan]:
        """The stages on device sets `dss` holding the parameter of canonical name `canon`."""
        return [s for si, s in enumerate(self.stages) if si % self.pp in dss and canon in self._stage_params(si)]

    def _stage_params(self, si: int) -> set[str]:
        """Canonical names of the parameters chunk `si` holds: a traced chunk's own (it holds a
        weight it reads outside the modules it runs, a tied head's), else the plan's
        (`validate.stage_parameters`)."""
        if si in getattr(self, "chunk_params", {}):
            return self.chunk_params[si]
        return stage_parameters(self.model, self.stages[si], self.aliases)

    def _placement_of(self, s: StagePlan, canon: str) -> tuple[str, ...]:
        """Stage `s`'s placement of the parameter `canon` as the plan records it and FSDP reads
        it: the canonical name's entry, else an alias's, else replicated."""
        pl = s.placements.get(canon)
        if pl is None:
            pl = next((v for k, v in s.placements.items() if self.aliases.get(k, k) == canon), None)
        return tuple(pl) if pl is not None else ("R",) * len(s.mesh_shape)

    def _full_tied_groups(self, dss: Sequence[int]) -> list[list[int]]:
        """Rank groups of a `FullTiedSync` across device sets `dss` of different meshes."""
        per = [replica_ranks(self.stages[d].devices, self.stages[d].mesh_shape, self.stages[d].mesh_axis_names)
               for d in dss]
        if fsdp_sharded(self.plan, [self.stages[d] for d in dss]):
            return [sorted(r for st in per for rs in st for r in rs)]
        return [sorted(r for st in per for r in st[rep]) for rep in range(len(per[0]))]

    def _mark_checkpoint_skip(self, dss: Sequence[int], names: Sequence[str]) -> None:
        """Tied copies in different layouts are saved once, by the first holder (DCP refuses a
        key that one rank saves whole and another sharded); every copy still loads it."""
        if any(self.rank in self.devsets[d] for d in dss[1:]):
            self.checkpoint_skip.update(names)

    def _local_copies(self, names: Sequence[str]) -> list[TiedEntry]:
        """(canonical name, this rank's copies of it) for each of `names` this rank holds: a
        traced chunk materialises its own copy of every parameter it reads, so a rank running
        two chunks that read one holds two; a parameter under several names in one chunk is
        one copy."""
        copies: dict[str, list[nn.Parameter]] = {}
        want = set(names)
        for core in self.local_modules:
            for n, p in core.named_parameters(remove_duplicate=False):
                canon = self.aliases.get(n, n)
                if canon in want:
                    held = copies.setdefault(canon, [])
                    if all(p is not q for q in held):
                        held.append(p)
        return [(n, copies[n]) for n in sorted(copies)]
