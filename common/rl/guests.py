"""Frozen models in a trained model's processes: the reference beside the actor, the reward model beside
the critic or the actor, when the resource plan puts them on the same GPUs.

With --colocate_actor_ref, --colocate_critic_reward or --colocate_all_models a frozen role (the
reference, the reward model) sits on a trained role's GPUs with as many workers. Each of its ranks then
loads into the trained role's rank of the same index (`ModelWorker.host`): one process per GPU instead
of two, so one CUDA context, and one caching allocator whose blocks the frozen model's no-grad forward
reuses after the trained model's activations freed them. The reference of the 3B bench held ~9 GiB in
a process of its own, 5.75 of them its weights (dev/LOG.md). Training is unchanged: the same
models run the same forward passes in the same order (tests/e2e/test_rl.py compares the two layouts).
HYBRIDRL_SHARE_PROCESS=0 keeps a process per role (for the bench's comparison).

Which frozen role goes into which trained role's processes is the resource plan's `hosts`
(common.cluster.resources), which the memory plan and --dry_run read too.
"""
from __future__ import annotations


class Host:
    """A worker's side (a mixin of common.rl.workers.ModelWorker): frozen models of other roles in its process."""

    def host(self, role: str, spec) -> dict:
        """Load a frozen model of another role (its ModelSpec) into this process, as this rank's share of that
        role: it shares this process's CUDA context and caching allocator. Returns setup's answer."""
        guest = type(self).__new__(type(self))  # the process's distributed group and environment are ours
        guest.role, guest.rank, guest.world_size, guest._master = role, self.rank, self.world_size, self._master
        info = guest.setup(spec)
        self.guests = {**getattr(self, "guests", {}), role: guest}
        return info

    def host_base(self, role: str) -> dict:
        """`role` (the reference) as this LoRA-trained model with its adapter switched off: no second copy of
        the weights, and exactly the base's numbers (common.training.lora.adapter_disabled)."""
        import copy

        guest = copy.copy(self)  # the same model, tokenizer and process group
        guest.adapter_off = True
        self.guests = {**getattr(self, "guests", {}), role: guest}
        return {"notes": [], "device": str(self.dist.device), "params": 0}

    def guest(self, role: str, method: str, *args, **kwargs):
        """A hosted role's method, as a RoleGroup would call it on that role's own worker."""
        return getattr(self.guests[role], method)(*args, **kwargs)


class GuestGroup:
    """A RoleGroup's calls for a role loaded into another group's workers: rank i's call goes to the host's
    rank i as `guest(role, method, ...)`."""

    def __init__(self, role: str, host):
        self.role, self.host = role, host
        self.placements, self.timeout_s = host.placements, host.timeout_s

    def __len__(self) -> int:
        return len(self.host)

    def async_call(self, method: str, *args, **kwargs) -> list:
        return self.host.async_call("guest", self.role, method, *args, **kwargs)

    def call(self, method: str, *args, **kwargs) -> list:
        from common.cluster.ray_groups import get

        return get(self.async_call(method, *args, **kwargs), self.timeout_s, f"{self.role}.{method}")

    def async_call_per_rank(self, method: str, args_per_rank: list[tuple], **kwargs) -> list:
        return self.host.async_call_per_rank("guest", [(self.role, method, *a) for a in args_per_rank], **kwargs)

    def call_per_rank(self, method: str, args_per_rank: list[tuple], **kwargs) -> list:
        from common.cluster.ray_groups import get

        return get(self.async_call_per_rank(method, args_per_rank, **kwargs), self.timeout_s, f"{self.role}.{method}")

    def shutdown(self) -> None:
        """Nothing of its own: the host's workers go with the host's group."""
