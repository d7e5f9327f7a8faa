"""All-reduce for tensor parallel 2: a one-shot kernel over CUDA IPC (one host) or over pinned host memory
moved by a proxy thread (two Sparks: RDMA, TCP, or a loopback copy), with NCCL for large messages.

    import twinspark.allreduce as ar
    comm = ar.create(group)                 # collective; transport by config/topology
    y = twinspark.ops.allreduce(x, comm)    # or comm.allreduce(x)

Pieces: ``Transport`` (base.py) is the one interface; ``IpcTransport`` (ipc.py), ``HostTransport``
(hostmem.py), ``DistTransport`` (nccl.py); ``Communicator`` picks one per call by size from the crossover
table in configs/allreduce.json (``python -m twinspark.allreduce.tune`` measures it); ``vllm_hook`` routes
vLLM's TP all-reduce here. Protocol details: cuda/allreduce/allreduce.h and cuda/allreduce_host/host_comm.h.
"""

from twinspark.allreduce.base import Transport
from twinspark.allreduce.communicator import Communicator, create
from twinspark.allreduce.config import AllreduceConfig, ConfigError, Crossover
from twinspark.allreduce.errors import AllreduceError, AllreduceTimeout, PeerFailed

__all__ = [
    "AllreduceConfig", "AllreduceError", "AllreduceTimeout", "Communicator", "ConfigError", "Crossover",
    "PeerFailed", "Transport", "create",
]
