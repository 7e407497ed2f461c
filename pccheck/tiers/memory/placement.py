"""Gemini's group placement (SOSP'23 §4): which nodes hold a node's in-memory replicas.

Nodes are cut into groups of ``m`` consecutive nodes; every member of a group holds the memory
checkpoint of every other member, so a group survives the loss of any m - 1 of its nodes. When
the node count is not divisible by m, Gemini's *mixed* placement is used: the first
``nodes // m - 1`` groups as above, the remaining ``m + nodes % m`` nodes (fewer than 2m) in a
ring, each node's replicas on the m - 1 nodes after it. Pure functions; no I/O.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from ...errors import ConfigError

__all__ = ["node_of_this_process", "replica_nodes", "replica_ranks", "group_of"]


def node_of_this_process(environ: Mapping[str, str] | None = None) -> int:
    """This process's node: ``PCCHECK_NODE``, else torchrun's ``GROUP_RANK``, else
    ``RANK // LOCAL_WORLD_SIZE``, else 0."""
    env = os.environ if environ is None else environ
    for key in ("PCCHECK_NODE", "GROUP_RANK"):
        if env.get(key, "") != "":
            return _nonneg(key, env[key])
    if env.get("RANK", "") != "" and env.get("LOCAL_WORLD_SIZE", "") != "":
        return _nonneg("RANK", env["RANK"]) // max(1, _nonneg("LOCAL_WORLD_SIZE", env["LOCAL_WORLD_SIZE"]))
    return 0


def _nonneg(key: str, value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not an integer") from None
    if v < 0:
        raise ConfigError(f"{key}={value!r} must be >= 0")
    return v


def _check(nodes: int, m: int) -> None:
    if m < 1:
        raise ConfigError(f"replicas must be >= 1, got {m}")
    if m > nodes:
        raise ConfigError(f"replicas={m} needs at least {m} nodes (each copy on another node); this job has "
                          f"{nodes} node(s): lower replicas, or set PCCHECK_NODE / GROUP_RANK per node")


def group_of(node: int, nodes: int, m: int) -> list[int]:
    """The nodes whose memory checkpoints ``node``'s group shares (itself included, ascending);
    for a node in the mixed tail, itself and the m - 1 ring successors."""
    _check(nodes, m)
    if not 0 <= node < nodes:
        raise ConfigError(f"node {node} is outside 0..{nodes - 1}")
    full = nodes // m if nodes % m == 0 else nodes // m - 1  # groups placed whole
    if node < full * m:
        base = node // m * m
        return list(range(base, base + m))
    start = full * m
    ring = nodes - start  # m <= ring < 2m
    return sorted(start + (node - start + j) % ring for j in range(m))


def replica_nodes(node: int, nodes: int, m: int) -> list[int]:
    """The m - 1 other nodes that hold ``node``'s memory checkpoint."""
    return [n for n in group_of(node, nodes, m) if n != node]


def replica_ranks(rank: int, node_of_rank: Sequence[int], m: int) -> list[int]:
    """The ranks that hold ``rank``'s memory checkpoint: on each replica node, the rank with the
    same local index (ranks of a node in ascending order; wrapping when that node has fewer)."""
    nodes = sorted(set(node_of_rank))
    if nodes != list(range(len(nodes))):
        raise ConfigError(f"node numbers must be 0..n-1 with every node present, got {nodes}")
    by_node = {n: [r for r, x in enumerate(node_of_rank) if x == n] for n in nodes}
    mine = node_of_rank[rank]
    local = by_node[mine].index(rank)
    return [by_node[n][local % len(by_node[n])] for n in replica_nodes(mine, len(nodes), m)]
