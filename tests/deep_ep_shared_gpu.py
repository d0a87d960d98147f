"""DeepEP's own low-latency test with several ranks on one GPU (``bash tools/gpu_check.sh deep-ep``: its
``deep_ep`` shim imports this beside moecomm.compat.deep_ep). DeepEP's init_dist puts rank i on GPU i and makes an
NCCL group, and NCCL refuses two ranks of a communicator on one GPU. Where a group has more ranks than the GPUs
visible, this adapts device selection only: the group is made with gloo (no device_id), ``torch.cuda.set_device(i)``
takes GPU i modulo the count, and ``all_gather_into_tensor`` takes DeepEP's stacked output [ranks, *shape] as the
[ranks * shape[0], *shape[1:]] gloo expects. Where every rank has its own GPU nothing is changed. DeepEP's files run
unchanged."""
import torch
import torch.distributed as dist

_GPUS = torch.cuda.device_count()
_init_process_group, _set_device, _all_gather_into_tensor = (dist.init_process_group, torch.cuda.set_device,
                                                             dist.all_gather_into_tensor)


def init_process_group(*args, **kwargs):
    if kwargs.get("world_size", 1) > _GPUS:
        kwargs["backend"] = "gloo"
        kwargs.pop("device_id", None)
    return _init_process_group(*args, **kwargs)


def set_device(device):
    index = device if isinstance(device, int) else torch.device(device).index
    return _set_device(index % _GPUS)


def all_gather_into_tensor(output, input, group=None, async_op=False):
    if dist.get_backend(group) == "gloo" and output.dim() == input.dim() + 1:
        output = output.view(-1, *input.shape[1:])
    return _all_gather_into_tensor(output, input, group=group, async_op=async_op)


if _GPUS:
    dist.init_process_group, torch.cuda.set_device, dist.all_gather_into_tensor = (init_process_group, set_device,
                                                                                   all_gather_into_tensor)
