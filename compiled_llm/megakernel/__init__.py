"""The megakernel backend: a decode step as one list of instructions per SM.

The post-pass decode graph is lowered into ops (one per fused op: norm + q/k/v + RoPE + KV
store, attention split along the context and the combine of its splits, o + residual, norm +
gate/up + activation, down + residual, the lm_head with its argmax), each cut into tiles of its
output columns. The scheduler assigns the tiles to SMs
and records what each waits for as counters in global memory that it waits on and bumps. The
result is plain data stored in the engine, and a CPU interpreter runs it with the reference ops
so that the dependency logic is tested on CPU like everything else; on a GPU one launch of
the persistent kernel runs it.

One idea a module, in the order a build uses them:

  schedule.py     the data: buffers, ops, instructions, the schedule, and its JSON form
  lowering.py     the post-pass FX graph -> ops (or a one-line refusal naming the node)
  tiling.py       what each tile of each op reads and writes (regions of buffers)
  scheduler.py    tiles -> SMs, with the counters each waits on and bumps, and time estimates
  check.py        a schedule's hazards: every read ordered after the writes it reads, no deadlock
  interpreter.py  runs a schedule on CPU with the reference ops, in an order the counters allow
  timeline.py     the per-SM timeline ``inspect`` shows
  encoding.py     a schedule + weights + buffers as the flat device tables the GPU kernel reads
  triton_kernel.py  the persistent Triton kernel: one program an SM runs its instructions
  program.py      a program whose decode steps run the schedule (the others: the per-op program)
"""
