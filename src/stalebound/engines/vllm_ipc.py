"""Weights from a trainer into a vLLM server on the same GPU, without a copy through the CPU.

The trainer's state dict stays on its GPU; the client sends CUDA IPC handles of its tensors
(:func:`ipc_handles`), and the server's GPU worker maps the same memory and loads it into the
served model (:class:`WeightIPC`, a vLLM worker extension). Use it when the trainer and the vLLM
server share a GPU on one machine:

* start the server with ``--worker-extension-cls stalebound.engines.vllm_ipc.WeightIPC`` (the
  server's Python environment must import ``stalebound``), and with the dev-mode endpoints
  (``VLLM_SERVER_DEV_MODE=1``, as ``stalebound serve-vllm`` does);
* create the engine as ``VLLMEngine(url, weight_transfer="cuda_ipc")`` (``engine.weight_transfer``
  in the config) and pass ``update_weights`` the trainer's state dict of CUDA tensors.

The handles are a pickle sent to the server's ``/collective_rpc`` endpoint: like every dev-mode
endpoint it trusts its caller, so bind the server to 127.0.0.1 (the default). The tensors must
stay alive until ``update_weights`` returns (the engine holds them until the server answers).
This path needs a CUDA GPU and the CUDA build of vLLM; it is not exercised on a machine without
them (see docs/models.md).
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Mapping
from typing import Any

__all__ = ["WeightIPC", "ipc_handles"]

# the device index in the arguments of torch.multiprocessing.reductions.rebuild_cuda_tensor
_DEVICE_ARG = 6


def ipc_handles(state: Mapping[str, Any]) -> str:
    """CUDA IPC handles of every tensor of ``state`` (all on a CUDA device), as one string."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = {}
    for name, tensor in state.items():
        if not getattr(tensor, "is_cuda", False):
            raise ValueError(
                f"state[{name!r}] is not a CUDA tensor; weight_transfer='cuda_ipc' sends GPU "
                "tensors only (use the default 'disk' transfer otherwise)"
            )
        _, args = reduce_tensor(tensor.detach().contiguous())  # type: ignore[no-untyped-call]
        handles[name] = args
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")


class WeightIPC:
    """A vLLM worker extension: ``update_weights_from_ipc(handles)`` loads the tensors the handles
    point at into the served model (through the model's own ``load_weights``)."""

    model_runner: Any

    def update_weights_from_ipc(self, handles: str) -> None:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        data: dict[str, tuple[Any, ...]] = pickle.loads(base64.b64decode(handles))
        device = torch.cuda.current_device()
        weights = []
        for name, args in data.items():
            local = list(args)
            local[_DEVICE_ARG] = device  # this process's index of the shared device
            weights.append((name, rebuild_cuda_tensor(*local)))  # type: ignore[no-untyped-call]
        self.model_runner.model.load_weights(weights=weights)
        torch.cuda.synchronize()
