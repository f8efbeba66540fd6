"""All-reduce over NVLink through symmetric memory, with the residual add fused:
``out = residual + sum over ranks of x``, one launch and one cross-GPU wait per call.

NCCL's all-reduce of a decode step's activations costs far more than moving them (a protocol
built for bandwidth, plus copies in and out of the graph's buffers and a separate residual add);
at 65 all-reduces a step it dominated a sharded decode. Here every rank holds one buffer that all
ranks can write (torch's symmetric memory: the same allocation mapped into every rank's address
space): a header of flags and counters, then two *parities* of one slot per rank. A call with
number ``e`` (the header's call counter plus one) uses parity ``e % 2``, and block ``b`` of each
rank's kernel

  1. stores its chunks of ``x`` into slot ``rank`` of that parity in every peer's buffer (stores
     over NVLink, which the GPU posts without waiting, where loads would each wait a round trip);
  2. sets flag (b, rank) in every peer's buffer to ``e`` (release, system scope), and waits until
     its own flags (b, peer) reach ``e`` (acquire);
  3. sums ``x`` and the peers' slots of its own buffer in rank order (every rank gets the same
     bits), adds the residual, and stores its chunks of ``out``.

Chunks grow with the call (``chunk_for``) so that the grid covers ``x`` in one pass where it can:
each block then keeps its chunk of ``x`` in registers from step 1 to step 3 and loads its
residual before the wait, so a large call's HBM reads overlap the peers' stores instead of
following them.

The last block to finish advances the call counter, which the next call reads once this kernel
is complete: by stream order, or, launched with PDL, after its ``pdl_wait``. That holds because
every kernel of ours that is launched with PDL waits on its predecessor before it finishes, so
"complete" chains along the stream.

Why one wait is enough: a rank writes parity ``p`` into a peer again only in call ``e + 2``. It
gets there after its call ``e + 1`` is complete, so after every block of that call heard from the
peer's call ``e + 1``, which the peer starts only once its call ``e`` (the last reader of parity
``p``) is complete. Flags only grow, so a signal that arrives early, from a peer one call ahead,
is still seen. Every rank makes the same calls in the same order with the same grids (capped
by the smallest SM count of the ranks, agreed when the workspace opens), so the counters agree;
a call that skips the kernel (empty, or larger than a slot: NCCL) skips it on every rank. A
block only waits on the same block of its peers, and the grid never exceeds any rank's
streaming multiprocessors, so every block is resident and the waits end; one that does not end
within ``timeout_s`` (a dead peer) traps, which fails the step instead of hanging it.

The workspace is per process, like the process group it belongs to: ``open_workspace`` after the
group starts, on every rank together; calls it cannot take (no workspace, larger than a slot) run
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

# elements a block moves per chunk: at least MIN_CHUNK (a small call's latency is its flags', not
# its bytes), at most MAX_CHUNK (x, the residual and the fp32 sum held in registers)
MIN_CHUNK = 2048
MAX_CHUNK = 8192
NUM_WARPS = 8
MAX_BLOCKS = 128
MAX_WORLD = 8
# int64 header: flags (block, sender), then the call counter and the count of finished blocks;
# padded so the slots start 256-byte aligned. 64-bit so the counters never wrap.
CALL_INDEX = MAX_BLOCKS * MAX_WORLD
DONE_INDEX = CALL_INDEX + 1
HEADER_BYTES = ((DONE_INDEX + 1) * 8 + 255) // 256 * 256
# The largest x (bytes) a call takes: a decode step of 256 sequences at hidden size 4096 in
# bf16. Larger calls (prefill chunks) stay on NCCL, whose rings are built for them. A multiple of
# 16 bytes, like the header, so that every slot starts aligned for 16-byte vector accesses.
DEFAULT_CAPACITY = 2 << 20
SLOT_ALIGN = 16
DEFAULT_TIMEOUT_S = 120.0


def buffer_bytes(world: int, capacity: int) -> int:
    """One rank's buffer: the header, then two parities of one ``capacity`` slot per rank."""
    return HEADER_BYTES + 2 * world * capacity


@dataclasses.dataclass(frozen=True)
class Workspace:
    """This rank's view of the symmetric buffers: ``bases`` holds every rank's buffer address
    (int64, on this rank's device), each laid out as ``buffer_bytes`` says."""

    rank: int
    world: int
    bases: torch.Tensor
    capacity: int
    timeout_ns: int
    max_blocks: int  # the grid's cap, the same on every rank (their GPUs may differ)
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
    if capacity % SLOT_ALIGN:
        raise ValueError(f"all-reduce slot capacity {capacity} is not a multiple of {SLOT_ALIGN} bytes")
    size = buffer_bytes(dist.get_world_size(), capacity)
    buffer = _attempt("allocation", lambda: _allocate(size, device, dist.get_world_size()))
    # every block must be resident on every rank (a block waits on the same block of its peers)
    allocated, max_blocks = _min_over_ranks([buffer is not None, min(MAX_BLOCKS, sm_count(device))], device)
    if not allocated:
        return None
    _rendezvous_made += 1
    handle = _attempt("rendezvous", lambda: _rendezvous(buffer))
    if not _min_over_ranks([handle is not None], device)[0]:
        return None
    bases = torch.tensor([handle.get_buffer(r, (size,), torch.uint8).data_ptr() for r in range(handle.world_size)],
                         dtype=torch.int64, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()  # every rank's header is zero before any rank signals
    return install(Workspace(handle.rank, handle.world_size, bases, capacity, int(timeout_s * 1e9), max_blocks,
                             handle, buffer))


def _allocate(size: int, device: torch.device, world: int) -> torch.Tensor:
    from torch.distributed import _symmetric_memory as symm_mem

    if world > MAX_WORLD:
        raise ValueError(f"{world} ranks, more than the {MAX_WORLD} the flags hold")
    buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
    buffer[:HEADER_BYTES].zero_()
    return buffer


def _rendezvous(buffer: torch.Tensor):
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm_mem

    handle = symm_mem.rendezvous(buffer, dist.group.WORLD)
    # the kernel's vector accesses take every mapping's start as 16-byte aligned
    misaligned = [r for r in range(handle.world_size)
                  if handle.get_buffer(r, tuple(buffer.shape), torch.uint8).data_ptr() % SLOT_ALIGN]
    if misaligned:
        raise ValueError(f"the buffers of ranks {misaligned} are not mapped {SLOT_ALIGN}-byte aligned")
    return handle


def _attempt(step: str, fn):
    """fn(), or None (logged) if it raises: any failure here means NCCL's path."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        log.warning("custom all-reduce unavailable: %s failed (%s); tensor-parallel steps use NCCL's",
                    step, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def _min_over_ranks(values: list[int], device: torch.device) -> list[int]:
    """Each value's minimum over the ranks (a collective); for flags, whether it holds on every
    rank."""
    import torch.distributed as dist

    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


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
    """A call the kernel takes: a workspace on x's device whose slot holds x."""
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
def _wait_at_least(ptr, value, timeout_ns, TIMER: tl.constexpr):
    """Spin until the flag at ``ptr`` (this rank's memory, written by a peer) reaches ``value``,
    with acquire semantics at system scope; trap after ``timeout_ns``."""
    start = _now_ns(TIMER)
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    while seen < value:
        if _now_ns(TIMER) - start > timeout_ns:
            _trap(TIMER)
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _peer_slot(bases, peer, rank, parity, slot_elems, dtype, WORLD: tl.constexpr, HEADER: tl.constexpr):
    """Slot ``rank`` of parity ``parity`` in ``peer``'s buffer (16-byte aligned: vector stores)."""
    slot = (tl.load(bases + peer) + HEADER).to(tl.pointer_type(dtype)) + (parity * WORLD + rank) * slot_elems
    return tl.multiple_of(slot, 16)


@triton.jit
def _signal_and_wait(bases, header, b, rank, call, timeout_ns, WORLD: tl.constexpr, TIMER: tl.constexpr):
    """Tell every peer's block b that this block's pushes are in, then hear from each (every
    thread's stores are visible to a peer that sees the flag: a block barrier, then a release at
    system scope)."""
    tl.debug_barrier()
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flags = tl.load(bases + peer).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flags + b * WORLD + rank, call, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != rank:
            _wait_at_least(header + b * WORLD + peer, call, timeout_ns, TIMER)
    tl.debug_barrier()


@triton.jit
def _store_sum(acc, r_ptr, out_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        # the sum rounds to x's dtype first, as the reference (all-reduce, then add) does
        acc = acc.to(dtype).to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(dtype), mask=mask)


@triton.jit
def _push_kernel(
    x_ptr, r_ptr, out_ptr, bases, rank, n, slot_elems, timeout_ns,
    WORLD: tl.constexpr, HEADER: tl.constexpr, CALL: tl.constexpr, DONE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, TIMER: tl.constexpr,
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    blocks = tl.num_programs(0)
    pdl_open(PDL)
    pdl_wait(PDL)
    dtype = x_ptr.dtype.element_ty
    own = tl.load(bases + rank)
    header = own.to(tl.pointer_type(tl.int64))
    call = tl.load(header + CALL, cache_modifier=".cg") + 1  # the previous call's kernel is complete
    parity = call % 2
    # the peers' slots of this call in our own buffer (read past L1: the peers wrote them)
    data = tl.multiple_of((own + HEADER).to(tl.pointer_type(dtype)) + parity * WORLD * slot_elems, 16)
    if ONE_PASS:
        # one chunk per block: x stays in registers from the push to the sum, and the residual,
        # which needs nothing from the peers, is loaded before the wait
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        for peer in tl.static_range(WORLD):
            if peer != rank:
                tl.store(_peer_slot(bases, peer, rank, parity, slot_elems, dtype, WORLD, HEADER) + offs, x, mask=mask)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        _signal_and_wait(bases, header, b, rank, call, timeout_ns, WORLD, TIMER)
        acc = tl.zeros((BLOCK,), tl.float32)
        for peer in tl.static_range(WORLD):  # rank by rank: every rank gets the same bits
            if peer == rank:
                v = x
            else:
                v = tl.load(data + peer * slot_elems + offs, mask=mask, other=0.0, cache_modifier=".cg")
            acc += v.to(tl.float32)
        if HAS_RESIDUAL:
            acc = acc.to(dtype).to(tl.float32) + r.to(tl.float32)  # the sum rounds first, as the reference's
        tl.store(out_ptr + offs, acc.to(dtype), mask=mask)
    else:
        # 1. x into our slot of every peer's buffer, chunk by chunk
        for peer in tl.static_range(WORLD):
            if peer != rank:
                slot = _peer_slot(bases, peer, rank, parity, slot_elems, dtype, WORLD, HEADER)
                for start in range(b * BLOCK, n, blocks * BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    mask = offs < n
                    tl.store(slot + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
        # 2. tell every peer's block b, then hear from each
        _signal_and_wait(bases, header, b, rank, call, timeout_ns, WORLD, TIMER)
        # 3. the sum, rank by rank, plus the residual
        for start in range(b * BLOCK, n, blocks * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            acc = tl.zeros((BLOCK,), tl.float32)
            for peer in tl.static_range(WORLD):
                if peer == rank:
                    v = tl.load(x_ptr + offs, mask=mask, other=0.0)
                else:
                    v = tl.load(data + peer * slot_elems + offs, mask=mask, other=0.0, cache_modifier=".cg")
                acc += v.to(tl.float32)
            _store_sum(acc, r_ptr, out_ptr, offs, mask, HAS_RESIDUAL)
    # the last block out advances the call counter (every block has read it by then)
    finished = tl.atomic_add(header + DONE, 1, sem="acq_rel", scope="gpu")
    if finished == blocks - 1:
        tl.store(header + DONE, 0)
        tl.store(header + CALL, call)


def chunk_for(n: int, ws: Workspace) -> int:
    """Elements a block moves per chunk: enough that the grid covers x in one pass (each block
    then holds its chunk in registers from push to sum), if MAX_CHUNK allows; a call that needs
    more loops over MIN_CHUNK chunks, which share out evenly over a grid capped below
    MAX_BLOCKS (GPUs with fewer SMs)."""
    one_pass = max(MIN_CHUNK, triton.next_power_of_2(triton.cdiv(n, ws.max_blocks)))
    return one_pass if one_pass <= MAX_CHUNK else MIN_CHUNK


def blocks_for(n: int, ws: Workspace) -> int:
    return max(1, min(triton.cdiv(n, chunk_for(n, ws)), ws.max_blocks))


def all_reduce(x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``cllm::all_reduce`` over the workspace of x's device (``handles(x)`` holds)."""
    if not handles(x):
        raise ValueError(f"custom all-reduce: no workspace on {x.device} holds a contiguous {tuple(x.shape)} {x.dtype}")
    ws = workspace_for(x)
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out if residual is None else out.copy_(residual)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    pdl = use_pdl(x)
    r = residual.contiguous() if residual is not None else x
    chunk, blocks = chunk_for(n, ws), blocks_for(n, ws)
    _push_kernel[(blocks,)](
        x, r, out, ws.bases, ws.rank, n, ws.capacity // x.element_size(), ws.timeout_ns,
        WORLD=ws.world, HEADER=HEADER_BYTES, CALL=CALL_INDEX, DONE=DONE_INDEX, HAS_RESIDUAL=residual is not None,
        BLOCK=chunk, ONE_PASS=blocks * chunk >= n, TIMER=not interpret, PDL=pdl, num_warps=NUM_WARPS,
        **pdl_launch(pdl),
    )
    return out
