"""Alpha-beta costs of collectives (nccl-tests PERFORMANCE.md conventions), over link classes,
logical meshes and device groups of a cluster.

For n devices, S bytes (the whole buffer: reduced, gathered, or before scattering), per-device
bandwidth B (bytes/s per direction) and latency alpha:
  all-reduce      2(n-1) alpha + 2(n-1)/n * S/B
  all-gather      (n-1) alpha + (n-1)/n * S/B
  reduce-scatter  (n-1) alpha + (n-1)/n * S/B
  all-to-all      (n-1) alpha + (n-1)/n * S/B
  send/recv       alpha + S/B
B is a bus bandwidth in nccl-tests' sense: busbw = algbw * 2(n-1)/n for all-reduce, so a profile
whose link bandwidth is a measured busbw reproduces the measured times at large sizes.

Over a cluster:
- a group of devices inside one node uses the intra-node link;
- a group with one device per node (a "rail") uses the inter-node link, each device its own NIC;
- an all-to-all over g > 1 devices in each of k > 1 nodes: each rank's share for its node's peers
  over NVLink and the rest over its NIC at once, the slower the time (`peerwise_all_to_all_time`:
  PyTorch's all_to_all_single is one NCCL send/receive per peer in a group);
- another collective over g > 1 devices in each of k > 1 nodes takes the cheapest of: g rail rings at once
  (NCCL's channels, one NIC each: bus bandwidth min(intra, g x inter), `rail_rings_time`); the
  hierarchical algorithm (Horovod/BytePS style: reduce-scatter inside the node, all-reduce of S/g
  across the nodes on g rails in parallel, all-gather inside the node; all-gather and
  reduce-scatter do their halves, `hierarchical_time`), which wins when the network is much
  slower than the node; and one flat ring at the slowest link.
- a logical mesh axis gets the alpha/beta of the slowest link any of its groups crosses (Alpa).
Measured tables (`LinkSpec.measured`: kind, num_devices, bytes, seconds) override the formulas:
linear interpolation in log-log between measured sizes, the measured bandwidth of the largest
size beyond it, the smallest time below it; other device counts are scaled by the formula's ratio.
A kind without rows of its own keeps the formula (an all-reduce's table says nothing of the ring
collectives where the switch reduces: 8x H200's NVLS all-reduce runs at 480 GB/s, its ring
all-gather and reduce-scatter at 361). A logical mesh axis whose groups all lie inside one
node carries the intra-node link (`LogicalMesh.links`), so the intra-op ILP times its collectives
from the same tables.
Intra-node tables describe groups inside one node; inter-node tables describe groups of whole
nodes (every device of each node taking part), the way nccl-tests is run across nodes.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from autopar.schema.cluster import ClusterSpec, LinkSpec, MeasuredCollective
from autopar.schema.mesh import LogicalMesh

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def collective_time(kind: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Seconds for collective `kind` of `nbytes` over `n` devices; beta = 1 / bandwidth."""
    if kind == "send_recv":
        return alpha + nbytes * beta if nbytes > 0 else 0.0
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * alpha + (n - 1) / n * nbytes * beta
    raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(COLLECTIVES)}")


def bus_factor(kind: str, n: int) -> float:
    """busbw / algbw for `kind` over `n` devices (nccl-tests PERFORMANCE.md)."""
    if kind == "send_recv":
        return 1.0
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


# -- measured tables ----------------------------------------------------------------------------

def _interp_table(pts: list[tuple[float, float]], nbytes: float) -> float:
    """Time at `nbytes` from sorted (bytes, seconds) points: log-log between points, the smallest
    time below the first, the last point's bandwidth beyond the last."""
    if nbytes <= pts[0][0]:
        return pts[0][1]
    if nbytes >= pts[-1][0]:
        b1, t1 = pts[-1]
        if len(pts) >= 2:
            b0, t0 = pts[-2]
            incr = (t1 - t0) / (b1 - b0) if b1 > b0 and t1 > t0 else t1 / b1
        else:
            incr = t1 / b1
        return t1 + (nbytes - b1) * incr
    lx = math.log(nbytes)
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if nbytes <= b1:
            w = (lx - math.log(b0)) / (math.log(b1) - math.log(b0))
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    return pts[-1][1]


def measured_time(kind: str, nbytes: float, n: int, link: LinkSpec) -> Optional[float]:
    """Seconds from `link.measured` for `kind` over `n` devices, or None without a table for
    `kind`. Uses the rows for `n` devices when present, else the nearest device count, scaled by
    the alpha-beta formula's ratio between `n` and that count."""
    rows: list[MeasuredCollective] = [m for m in link.measured if m.kind == kind]
    if not rows or nbytes <= 0 or (n <= 1 and kind != "send_recv"):
        return None
    counts = sorted({m.num_devices for m in rows})
    m_n = n if n in counts else min(counts, key=lambda c: (abs(math.log(c / max(n, 1))), c))
    pts = sorted((m.bytes, m.seconds) for m in rows if m.num_devices == m_n)
    # keep times non-decreasing in size so the table never says bigger is faster
    mono: list[tuple[float, float]] = []
    for b, t in pts:
        if mono and b == mono[-1][0]:
            mono[-1] = (b, min(mono[-1][1], t))
            continue
        mono.append((b, max(t, mono[-1][1]) if mono else t))
    t = _interp_table(mono, nbytes)
    if m_n != n and kind != "send_recv":
        alpha, beta = link.latency, 1.0 / link.bandwidth
        ref = collective_time(kind, nbytes, m_n, alpha, beta)
        if ref > 0:
            t *= collective_time(kind, nbytes, n, alpha, beta) / ref
    return t


def link_collective_time(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds for `kind` over `n` devices on one link class: the measured table when it has
    `kind`, else the alpha-beta formula with the link's latency and bandwidth."""
    if nbytes <= 0 or (n <= 1 and kind != "send_recv"):
        return 0.0
    t = measured_time(kind, nbytes, n, link)
    if t is not None:
        return t
    return collective_time(kind, nbytes, n, link.latency, 1.0 / link.bandwidth)


# -- cluster groups -----------------------------------------------------------------------------

def _nodes_of(cluster: ClusterSpec, group: Sequence[int]) -> dict[int, list[int]]:
    by: dict[int, list[int]] = {}
    for r in group:
        if not 0 <= r < cluster.num_devices:
            raise ValueError(f"rank {r} is outside the cluster's {cluster.num_devices} devices")
        by.setdefault(r // cluster.devices_per_node, []).append(r)
    return by


def slowest_link(cluster: ClusterSpec, group: Sequence[int]) -> LinkSpec:
    """The slowest link class a group of ranks crosses (inter-node as soon as it spans nodes)."""
    if len(_nodes_of(cluster, group)) > 1 and cluster.inter_node is not None:
        inter, intra = cluster.inter_node, cluster.intra_node
        return inter if inter.bandwidth <= intra.bandwidth else intra
    return cluster.intra_node


def axis_collective_time(kind: str, nbytes: float, cluster: ClusterSpec, group: Sequence[int]) -> float:
    """Seconds for collective `kind` of `nbytes` among the global ranks `group` of `cluster`
    (see the module docstring: intra-node, rail, or hierarchical across nodes; measured tables
    first). For send_recv, `group` is [src, dst]."""
    group = list(dict.fromkeys(group))
    n = len(group)
    if nbytes <= 0 or (n <= 1 and kind != "send_recv"):
        return 0.0
    nodes = _nodes_of(cluster, group)
    intra, inter = cluster.intra_node, cluster.inter_node or cluster.intra_node
    if len(nodes) == 1:
        return link_collective_time(kind, nbytes, max(n, 2) if kind == "send_recv" else n, intra)
    if kind == "send_recv":
        return link_collective_time(kind, nbytes, 2, inter)
    k = len(nodes)
    sizes = {len(v) for v in nodes.values()}
    g = min(sizes)
    whole_nodes = sizes == {cluster.devices_per_node}
    if whole_nodes and measured_time(kind, nbytes, n, inter) is not None:
        return measured_time(kind, nbytes, n, inter)  # type: ignore[return-value]
    flat = collective_time(kind, nbytes, n, max(intra.latency, inter.latency),
                           1.0 / min(intra.bandwidth, inter.bandwidth))
    if kind == "all_to_all" and g > 1 and len(sizes) == 1:
        return peerwise_all_to_all_time(nbytes, g, k, intra, inter)
    if g == 1 or len(sizes) > 1 or kind == "all_to_all":
        # one device per node (a rail), or an irregular group: flat ring at the slowest link
        if g == 1 and len(sizes) == 1:
            return link_collective_time(kind, nbytes, n, inter)
        return flat
    return min(flat, rail_rings_time(kind, nbytes, g, k, intra, inter),
               hierarchical_time(kind, nbytes, g, k, intra, inter))


def peerwise_all_to_all_time(nbytes: float, g: int, k: int, intra: LinkSpec, inter: LinkSpec) -> float:
    """An all-to-all of `nbytes` (a rank's whole send buffer) over g devices in each of k nodes as
    PyTorch runs it on NCCL: one ncclSend / ncclRecv per peer inside one NCCL group
    (torch/csrc/cuda/nccl.cpp `all2all_single_equal_split`, `all2all_single_unequal_split`), which
    NCCL issues at once, each peer over its own transport: the g - 1 peers in the node over NVLink
    (P2P), the g (k - 1) others over the network (NET, each GPU its own NIC on a rail-optimised
    node). A rank's (g - 1) / n of the buffer rides NVLink and (n - g) / n the network, at once;
    the slower sets the time (the node's share on the intra-node link's measured all-to-all where
    it has one)."""
    n = g * k
    local = link_collective_time("all_to_all", nbytes * g / n, g, intra)
    remote = (n - g) * inter.latency + (n - g) / n * nbytes / inter.bandwidth
    return max(local, remote)


def rail_rings_time(kind: str, nbytes: float, g: int, k: int, intra: LinkSpec, inter: LinkSpec) -> float:
    """`kind` over g devices in each of k nodes as NCCL runs it on rail-optimised clusters: g rings
    (channels) at once, each leaving the node through a different NIC, so the ring's bus bandwidth
    is min(intra bandwidth, g x per-device inter-node bandwidth) and every step pays the slower
    latency. DGX A100 (8 x 24 GB/s NICs): min(230, 192) = 192 GB/s, the measured cross-node busbw."""
    bw = min(intra.bandwidth, g * inter.bandwidth)
    return collective_time(kind, nbytes, g * k, max(intra.latency, inter.latency), 1.0 / bw)


def hierarchical_time(kind: str, nbytes: float, g: int, k: int, intra: LinkSpec, inter: LinkSpec) -> float:
    """`kind` over g devices in each of k nodes, in two levels: inside the node on `intra`, then
    across nodes on g parallel rails of `inter` each carrying 1/g of the data.
    all-reduce = reduce-scatter(g) + all-reduce(k, S/g) + all-gather(g);
    all-gather = all-gather(k, S/g) across nodes on each rail + all-gather(g, S) inside the node;
    reduce-scatter = reduce-scatter(g) + reduce-scatter(k, S/g)."""
    if kind == "all_reduce":
        return (link_collective_time("reduce_scatter", nbytes, g, intra)
                + link_collective_time("all_reduce", nbytes / g, k, inter)
                + link_collective_time("all_gather", nbytes, g, intra))
    if kind == "all_gather":
        return (link_collective_time("all_gather", nbytes / g, k, inter)
                + link_collective_time("all_gather", nbytes, g, intra))
    if kind == "reduce_scatter":
        return (link_collective_time("reduce_scatter", nbytes, g, intra)
                + link_collective_time("reduce_scatter", nbytes / g, k, inter))
    return collective_time(kind, nbytes, g * k, inter.latency, 1.0 / inter.bandwidth)


# -- logical meshes -----------------------------------------------------------------------------

def axis_groups(devices: Sequence[int], shape: tuple[int, ...], axis: int) -> list[list[int]]:
    """The device groups along `axis` when `devices` are laid row-major over `shape`."""
    import numpy as np

    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh shape {shape} holds {math.prod(shape)} devices, got {len(devices)}")
    arr = np.asarray(list(devices)).reshape(shape)
    moved = np.moveaxis(arr, axis, -1).reshape(-1, shape[axis])
    return [list(map(int, row)) for row in moved]


def logical_mesh(cluster: ClusterSpec, devices: Sequence[int], shape: tuple[int, ...]) -> LogicalMesh:
    """A LogicalMesh of `devices` (global ranks) laid row-major over `shape`; each axis gets the
    latency and 1/bandwidth of the slowest link any of its groups crosses, and the mesh carries
    `cluster.device` so compute is costed."""
    shape = tuple(int(s) for s in shape)
    alphas, betas, measured = [], [], []
    for ax in range(len(shape)):
        groups = axis_groups(devices, shape, ax)
        links = [slowest_link(cluster, grp) for grp in groups] if shape[ax] > 1 else [cluster.intra_node]
        worst = min(links, key=lambda l: l.bandwidth)
        alphas.append(max(l.latency for l in links))
        betas.append(1.0 / worst.bandwidth)
        # every group inside one node: the intra-node link's measured timings time the axis
        inside = shape[ax] > 1 and all(len(_nodes_of(cluster, grp)) == 1 for grp in groups)
        measured.append(cluster.intra_node if inside and cluster.intra_node.measured else None)
    return LogicalMesh(shape=shape, alpha=tuple(alphas), beta=tuple(betas), device=cluster.device,
                       links=tuple(measured) if any(m is not None for m in measured) else None)


def mesh_axis_collective_time(kind: str, nbytes: float, cluster: ClusterSpec, devices: Sequence[int],
                              shape: tuple[int, ...], axis: int) -> float:
    """Seconds of `kind` along `axis` of the mesh of `devices` laid over `shape`: the slowest of
    its groups, each costed by `axis_collective_time` (the groups run concurrently)."""
    return max(axis_collective_time(kind, nbytes, cluster, grp) for grp in axis_groups(devices, shape, axis))
