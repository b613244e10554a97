"""A coupled instance: prefill and decode on the same GPU, the way one vLLM instance works.

Without chunked prefill a prefill takes the whole GPU: the running batch stops at its next step
boundary, the prefill runs, and the batch resumes (with the new request in it) only when no
prefill is waiting. Every member of the batch sees that pause as one long inter-token interval,
which is what disaggregation removes.
"""

from __future__ import annotations

from tools.sim.instances import DecodeInstance, Nic, PoolNode, PrefillInstance


class CoupledInstance(PrefillInstance):
    def __init__(self, instance_id: str, pool: PoolNode, nic: Nic, decode: DecodeInstance) -> None:
        super().__init__(instance_id, pool, nic)
        self.decode = decode

    def claim_gpu(self, t: float) -> float:
        """Pause the batch; the prefill may start at the returned step boundary."""
        end = self.decode.batch.pause(t)
        self.decode.changed()
        return end

    def release_gpu(self, t: float) -> None:
        """Let the batch run again (the finishing request joins it right after)."""
        self.decode.batch.resume(t)
        self.decode.changed()
