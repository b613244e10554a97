"""Which messenger speaks for each node.

A messenger's heartbeat names its node, and what it says there (its pool's state, its leaving)
changes what the cluster believes about every block on that node. The bus ties a heartbeat to the
instance that sent it, not to the node it names; so a node is held by the first messenger heard
for it, until that one leaves or is forgotten (silent past the timeout), and another messenger's
word about the node meanwhile is a spoof: ignored, counted and audited by the caller. Pure.
"""

from __future__ import annotations


class NodeHolders:
    def __init__(self) -> None:
        self._holder: dict[str, str] = {}  # node -> the messenger instance that speaks for it

    def claim(self, node: str, instance_id: str) -> bool:
        """Whether `instance_id` may speak for `node` (it holds it now, or nobody did)."""
        return self._holder.setdefault(node, instance_id) == instance_id

    def release(self, node: str, instance_id: str) -> None:
        """`instance_id` no longer speaks for `node` (it left, or was forgotten)."""
        if self._holder.get(node) == instance_id:
            del self._holder[node]

    def holder(self, node: str) -> str | None:
        return self._holder.get(node)

    def forget(self, node: str) -> None:
        """Nobody speaks for `node` now (its entries were dropped: silent past the timeout)."""
        self._holder.pop(node, None)
