"""The rendezvous of `distflow train --nproc N`: every socket of a one-machine run on loopback only.

torch's elastic agent opens two TCPStore servers (the c10d rendezvous store, and the store it shares
with its ranks, whose address they get as MASTER_ADDR), and a TCPStore server listens on every
interface whatever host name it is given (`*`, also for `127.0.0.1:0`): torch has no bind address,
only `master_listen_fd`, a socket bound beforehand. So the launcher registers a rendezvous backend of
its own, the c10d one with both stores served on sockets bound to 127.0.0.1, and gives its agent
`local_addr=127.0.0.1` (the ranks' MASTER_ADDR). Gloo, for its part, listens on the address that the
host name resolves to, which may be the machine's network address: its interface is loopback's
(GLOO_SOCKET_IFNAME) unless the user named one.

A multi-node run is started by torchrun, which opens its stores itself (listening on every
interface, as above); there GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME choose the ranks' interface.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

LOOPBACK = "127.0.0.1"
BACKEND = "distflow-loopback"


def loopback_store(port: int = 0) -> dist.TCPStore:
    """A TCPStore server on LOOPBACK:`port` (0: a free one, then `.port`), reachable from this machine only."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, port))
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    # The store's server owns the socket from here (it listens on it and closes it).
    return dist.TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, master_listen_fd=listener.detach())


class _LoopbackRendezvous(DynamicRendezvousHandler):
    """torch's c10d rendezvous, whose store shared with the ranks is also served on loopback only."""

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        return loopback_store(master_port)

    def get_backend(self) -> str:
        return BACKEND


def _create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    store = loopback_store()
    return _LoopbackRendezvous.from_backend(
        params.run_id, store, C10dRendezvousBackend(store, params.run_id), params.min_nodes, params.max_nodes, LOOPBACK
    )


def use_loopback() -> str:
    """Register the backend (its name, for `LaunchConfig.rdzv_backend`) and choose gloo's interface."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)  # again: the same creator, accepted
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    return BACKEND


def loopback_interface() -> str:
    """The name of this machine's loopback interface (`lo` on Linux, `lo0` on macOS and the BSDs)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(f"no loopback interface (lo, lo0) among {names}: set GLOO_SOCKET_IFNAME to it")
