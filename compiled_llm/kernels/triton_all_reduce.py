"""One-shot all-reduce over NVLink through symmetric memory, with the residual add fused:
``out = residual + sum over ranks of x``, one launch at decode sizes.

NCCL's all-reduce of a decode step's few kilobytes costs far more than moving them (a protocol
built for bandwidth, plus a copy out of the graph's buffers); at 65 all-reduces a step it
dominated a sharded decode. Here every rank holds one buffer that all ranks can read
(torch's symmetric memory: the same allocation mapped into every rank's address space), and
block ``b`` of each rank's kernel

  1. copies its chunks of ``x`` into its own buffer,
  2. tells block ``b`` of every other rank so, and waits to hear the same from each (a flag per
     (block, sender) in the receiver's buffer, set 0 -> 1 by the sender with release semantics,
     taken 1 -> 0 by the receiver with acquire semantics, so a flag is never set twice unseen),
  3. reads those chunks from every peer's buffer (past L1, which may hold an older call's),
     sums them over the ranks in rank order (every rank gets the same bits), adds the residual,
     and stores them,
  4. meets the others once more, so that no rank overwrites its buffer in the next call while a
     peer still reads it.

A block only ever waits on the same block of its peers, and the grid never exceeds the
streaming multiprocessors, so every block of every rank is resident and the waits end. A wait
that does not end within ``timeout_s`` (a dead peer) traps, which fails the step instead of
hanging it.

The workspace is per process, like the process group it belongs to: ``open_workspace`` after
the group starts, on every rank together; calls it cannot take (no workspace, too large) run
the op's reference, NCCL.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from compiled_llm.kernels.triton_common import pdl_launch, pdl_open, pdl_wait, sm_count, use_pdl

log = logging.getLogger(__name__)

BLOCK = 2048  # elements a block moves per chunk
MAX_BLOCKS = 64
MAX_WORLD = 8
FLAG_BYTES = 2 * MAX_BLOCKS * MAX_WORLD * 4  # two barriers x blocks x senders, int32 flags
# The largest x (bytes) a call takes: a decode step of a few sequences. One block per chunk
# pulls each peer's chunk over NVLink at latency, so past some tens of rows NCCL's pipelined
# rings move the bytes faster; those calls (larger decode batches, prefill) stay on NCCL.
DEFAULT_CAPACITY = 128 << 10
DEFAULT_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Workspace:
    """This rank's view of the symmetric buffers: ``bases`` holds every rank's buffer address
    (int64, on this rank's device), each buffer FLAG_BYTES of flags then ``capacity`` bytes."""

    rank: int
    world: int
    bases: torch.Tensor
    capacity: int
    timeout_ns: int
    handle: object  # keeps the symmetric allocation alive
    buffer: torch.Tensor


_WORKSPACES: dict[torch.device, Workspace] = {}
_rendezvous_made = 0  # by this process (see rendezvous_count)


def rendezvous_count() -> int:
    """Symmetric-memory rendezvous this process has attempted (multiproc opens one workspace per
    process: torch counts them per process, pytorch#196082)."""
    return _rendezvous_made


def open_workspace(device: torch.device, capacity: int = DEFAULT_CAPACITY,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> Optional[Workspace]:
    """Allocate and exchange this rank's buffer (a collective: every rank of the default group
    calls it together). Returns None on every rank, leaving the NCCL path, where symmetric memory
    cannot be had on some rank (no peer access between the GPUs, a torch without it, no memory).
    The ranks agree after each step that may fail, outside it, so a rank that fails never waits
    in a different collective from the others."""
    import torch.distributed as dist

    global _rendezvous_made
    size = FLAG_BYTES + capacity
    buffer = _attempt("allocation", lambda: _allocate(size, device, dist.get_world_size()))
    if not _on_every_rank(buffer is not None, device):
        return None
    _rendezvous_made += 1
    handle = _attempt("rendezvous", lambda: _rendezvous(buffer))
    if not _on_every_rank(handle is not None, device):
        return None
    bases = torch.tensor([handle.get_buffer(r, (size,), torch.uint8).data_ptr() for r in range(handle.world_size)],
                         dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    dist.barrier()  # every rank's flags are zero before any rank signals
    return install(Workspace(handle.rank, handle.world_size, bases, capacity, int(timeout_s * 1e9), handle, buffer))


def _allocate(size: int, device: torch.device, world: int) -> torch.Tensor:
    from torch.distributed import _symmetric_memory as symm_mem

    if world > MAX_WORLD:
        raise ValueError(f"{world} ranks, more than the {MAX_WORLD} the flags hold")
    buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
    buffer[:FLAG_BYTES].zero_()
    return buffer


def _rendezvous(buffer: torch.Tensor):
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm_mem

    return symm_mem.rendezvous(buffer, dist.group.WORLD)


def _attempt(step: str, fn):
    """fn(), or None (logged) if it raises: any failure here means NCCL's path."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        log.warning("one-shot all-reduce unavailable: %s failed (%s); tensor-parallel steps use NCCL's",
                    step, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def _on_every_rank(ok: bool, device: torch.device) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def install(ws: Workspace) -> Workspace:
    """Make ``ws`` the workspace of its device's calls (open_workspace; tests that lay out
    buffers themselves)."""
    _WORKSPACES[ws.bases.device] = ws
    return ws


def close_workspace(device: torch.device) -> None:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _WORKSPACES.pop(device, None)


def workspace_for(x: torch.Tensor) -> Optional[Workspace]:
    return _WORKSPACES.get(x.device)


def handles(x: torch.Tensor) -> bool:
    """A call the kernel takes: a workspace on x's device that holds x."""
    ws = workspace_for(x)
    return ws is not None and x.numel() * x.element_size() <= ws.capacity and x.is_contiguous()


@triton.jit
def _now_ns(TIMER: tl.constexpr):
    if TIMER:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = tl.full((), 0, tl.int64)
    return t


@triton.jit
def _trap(TIMER: tl.constexpr):
    if TIMER:
        tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cas_until(ptr, cmp, val, timeout_ns, SEM: tl.constexpr, TIMER: tl.constexpr):
    """Swap ``cmp`` for ``val`` at ``ptr`` (system scope), retrying until the swap takes; trap
    after ``timeout_ns``."""
    start = _now_ns(TIMER)
    seen = tl.atomic_cas(ptr, cmp, val, sem=SEM, scope="sys")
    while seen != cmp:
        if _now_ns(TIMER) - start > timeout_ns:
            _trap(TIMER)
        seen = tl.atomic_cas(ptr, cmp, val, sem=SEM, scope="sys")


@triton.jit
def _barrier(bases, rank, slot0, timeout_ns, WORLD: tl.constexpr, TIMER: tl.constexpr):
    """Signal flag ``slot0 + rank`` in every peer's buffer, then take flags ``slot0 + peer`` in
    ours. Block-wide: every thread's earlier stores are visible to peers that take our flag."""
    tl.debug_barrier()
    own = tl.load(bases + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flags = tl.load(bases + peer).to(tl.pointer_type(tl.int32))
            _cas_until(flags + slot0 + rank, 0, 1, timeout_ns, "release", TIMER)  # 0 -> 1: set
    for peer in tl.static_range(WORLD):
        if peer != rank:
            _cas_until(own + slot0 + peer, 1, 0, timeout_ns, "acquire", TIMER)  # 1 -> 0: taken
    tl.debug_barrier()


@triton.jit
def _one_shot_kernel(
    x_ptr, r_ptr, out_ptr, bases, rank, n, timeout_ns,
    WORLD: tl.constexpr, FLAGS: tl.constexpr, MAXB: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr, TIMER: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)
    blocks = tl.num_programs(0)
    pdl_open(PDL)
    pdl_wait(PDL)
    dtype = x_ptr.dtype.element_ty
    own = (tl.load(bases + rank) + FLAGS).to(tl.pointer_type(dtype))
    for start in range(b * BLOCK, n, blocks * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(own + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _barrier(bases, rank, b * WORLD, timeout_ns, WORLD, TIMER)
    for start in range(b * BLOCK, n, blocks * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.zeros((BLOCK,), tl.float32)
        for peer in tl.static_range(WORLD):
            if peer == rank:
                v = tl.load(x_ptr + offs, mask=mask, other=0.0)
            else:
                buf = (tl.load(bases + peer) + FLAGS).to(tl.pointer_type(dtype))
                v = tl.load(buf + offs, mask=mask, other=0.0, cache_modifier=".cg")  # not L1: a peer wrote it
            acc += v.to(tl.float32)
        if HAS_RESIDUAL:
            # the sum rounds to x's dtype first, as the reference (all-reduce, then add) does
            acc = acc.to(dtype).to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(dtype), mask=mask)
    _barrier(bases, rank, (MAXB + b) * WORLD, timeout_ns, WORLD, TIMER)


def blocks_for(n: int, device: torch.device) -> int:
    return max(1, min(triton.cdiv(n, BLOCK), MAX_BLOCKS, sm_count(device)))


def all_reduce(x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``cllm::all_reduce`` over the workspace of x's device (``handles(x)`` holds)."""
    if not handles(x):
        raise ValueError(f"one-shot all-reduce: no workspace on {x.device} holds a contiguous {tuple(x.shape)} {x.dtype}")
    ws = workspace_for(x)
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out if residual is None else out.copy_(residual)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    pdl = use_pdl(x)
    r = residual.contiguous() if residual is not None else x
    _one_shot_kernel[(blocks_for(n, x.device),)](
        x, r, out, ws.bases, ws.rank, n, ws.timeout_ns,
        WORLD=ws.world, FLAGS=FLAG_BYTES, MAXB=MAX_BLOCKS, HAS_RESIDUAL=residual is not None,
        BLOCK=BLOCK, TIMER=not interpret, PDL=pdl, num_warps=8, **pdl_launch(pdl),
    )
    return out
