"""The trainer's end of an NCCL weight-broadcast group (`deployment.weight_sync='nccl'`).

The trainer is rank 0, the sender; the server's GPUs are ranks 1..N. How the group is formed
depends on the server: `TorchNCCLBroadcaster` is a plain torch process group (what SGLang's
workers build); vLLM's workers need vLLM's own classes (`vllm.VLLMNCCLBroadcaster`).
Both are UNTESTED ON HARDWARE: the tests drive the weight syncs with a recording fake.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from training.utils.errors import DeploymentError


class NCCLBroadcaster:
    """Rank 0 of `world_size`. `rendezvous` and `broadcast` block; the weight sync runs them on a
    worker thread while the HTTP call that makes the server join or receive is in flight."""

    def rendezvous(self, master_address: str, master_port: int, world_size: int, timeout_s: float) -> None:
        raise NotImplementedError

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise DeploymentError("weight_sync='nccl' needs a CUDA device in the trainer process")


def on_cuda(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as NCCL sends it: contiguous, on this process's CUDA device."""
    require_cuda()
    return tensor.detach().to(torch.cuda.current_device()).contiguous()


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as the servers' weight-update requests name it (`bfloat16`, not `torch.bfloat16`)."""
    return str(dtype).removeprefix("torch.")


class TorchNCCLBroadcaster(NCCLBroadcaster):
    """A torch process group over a TCP store at `master_address:master_port` whose keys live under
    `PrefixStore(group_name)`; the trainer hosts that store (rank 0) and builds its group with
    torch's group helper rather than `init_process_group`, which would take over the default group
    FSDP uses."""

    def __init__(self, group_name: str):
        self.group_name = group_name
        self._group = None

    def rendezvous(self, master_address, master_port, world_size, timeout_s):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper

        require_cuda()
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout)
        self._group, _ = _new_process_group_helper(
            world_size, 0, [], Backend("nccl"), PrefixStore(self.group_name, store),
            group_name=self.group_name, timeout=timeout,
        )

    def broadcast(self, tensors):
        for tensor in tensors:
            self._group.broadcast(on_cuda(tensor), 0).wait()
        torch.cuda.synchronize()

    def close(self):
        self._group = None
