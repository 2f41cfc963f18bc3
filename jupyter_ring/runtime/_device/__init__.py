"""The runtime over torch.distributed: the device transport and the process groups under it.

- ``transport``: ``DeviceTransport``, collectives on device buffers (torch CUDA tensors, cupy
  through DLPack) over an NCCL group (gloo on CPU for tests), polled by CUDA events, aborted on
  a stall;
- ``agreement``: the vote over the ring before every device collective (mismatch, a peer's bad
  arguments, a join, a group to re-create);
- ``groups``: which group a device type uses (the user's default one, or ours over our own
  rendezvous store);
- ``process_groups``: torch.distributed groups that can be aborted and re-created in place (ours
  and the users' DDP/FSDP ones), with the registry the engine-side guard reads;
- ``torch_comm``: torch.distributed's own collectives counted in the ring's trace.

Imports torch only inside functions (this package is imported where torch may be absent), the
numpy API (``jupyter_ring.runtime``: agreement on what the ranks hold goes through it),
``.._engine`` and ``.._observe``; never an adapter.
"""
