"""`compiled-llm run ENGINE_DIR|SOURCE`: the compiled runtime behind the run command (a model
SOURCE is built into the engine cache first, or loaded from it: compiled_llm.engine.cache).

Same prompts, sampling options and output formats as the reference path (cli/run.py), plus
--stream, --interactive (chat REPL), --profile and the engine sizing knobs. Prints a perf
summary: load, graph capture, time to first token, prefill and decode throughput.
"""

from __future__ import annotations

import statistics
import sys
import time


def engine_of(args, device) -> str:
    """The engine directory to run: SOURCE itself, or its cached engine (built on first use)."""
    from compiled_llm.cli.run import is_engine_dir

    if is_engine_dir(args.source):
        return args.source
    from compiled_llm.engine.cache import cached_engine

    return str(cached_engine(args.source, dtype=args.dtype, device=device))


def build_llm(args):
    from compiled_llm.cli.engine_args import engine_options
    from compiled_llm.cli.run import resolve_device
    from compiled_llm.serve.llm import LLM

    device = resolve_device(args.device)
    dtype = None if args.dtype == "auto" else args.dtype
    return LLM(engine_of(args, device), dtype=dtype, device=device, **engine_options(args))


def run_engine(args) -> int:
    from compiled_llm.cli.run import (check_prompt_args, print_outputs, print_run_header, prompts_from_args,
                                      sampling_from_args)
    from compiled_llm.serve.profiling import profile_engine

    sampling = sampling_from_args(args)  # bad values fail before anything loads (or builds)
    check_prompt_args(args)
    t0 = time.perf_counter()
    llm = build_llm(args)
    load_s = time.perf_counter() - t0
    engine = llm.engine
    if args.interactive:
        return chat(llm, sampling, args.system_prompt)
    prompts = prompts_from_args(args, llm.tokenizer)
    requests = [{"prompt_token_ids": p} for p in prompts]
    texts = list(args.prompt or []) + list(args.prompt_ids or [])

    t_run = time.perf_counter()
    with profile_engine(args.profile, engine, engine.device):
        if args.stream and not args.json:
            outputs = []
            for i, (req, text) in enumerate(zip(requests, texts)):
                print(f"=== prompt {i} ({len(req['prompt_token_ids'])} tokens) ===\n{text}\n--- output ---", flush=True)
                stream = llm.stream(req, sampling)
                for delta in stream:
                    print(delta, end="", flush=True)
                out = stream.output
                outputs.append(out)
                print(f"\n--- ({len(out.token_ids)} tokens, finish: {out.finish_reason}) ---\n", flush=True)
        else:
            outputs = llm.generate(requests, sampling, use_tqdm=not args.json and sys.stderr.isatty())
    wall = time.perf_counter() - t_run

    if not args.stream or args.json:
        print_outputs(outputs, texts, args.json)
    if not args.json:
        preset = ((llm.model.manifest or {}).get("source") or {}).get("preset")
        from compiled_llm.cli.run import is_engine_dir

        where = "compiled runtime" if is_engine_dir(args.source) else f"compiled runtime, cached engine {llm.model.name}"
        print_run_header(args.source, engine.device, llm.model.dtype, where, preset)
        print(perf_summary(llm, outputs, load_s, wall))
    return 0


def perf_summary(llm, outputs, load_s: float, wall_s: float) -> str:
    st = llm.stats
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    rate = lambda n, s: f"{n / s:,.1f} tok/s" if s > 0 else "n/a"  # noqa: E731
    graphs = f"{st.graph_capture_s:.3f} s" if st.graphs_captured else "-"
    pc = llm.engine.block_manager.stats
    rows = [
        ("load", f"{load_s:.3f} s", f"KV cache {st.kv_num_blocks} blocks"),
        ("graphs", graphs, f"{st.graphs_captured} decode buckets captured" if st.graphs_captured else "eager decode"),
        ("ttft", f"{(statistics.median(ttfts) if ttfts else 0):.3f} s", "median time to first token"),
        ("prefill", f"{st.prefill_s:.3f} s", f"{st.prefill_tokens} tokens, {rate(st.prefill_tokens, st.prefill_s)}"),
        ("decode", f"{st.decode_s:.3f} s", f"{st.decode_tokens} tokens, {rate(st.decode_tokens, st.decode_s)}"),
        ("total", f"{wall_s:.3f} s", f"{st.generated_tokens} tokens generated, {rate(st.generated_tokens, wall_s)}"),
        ("cache", "", f"prefix-cache hits {pc.hit_tokens} tokens, preemptions {llm.engine.scheduler.num_preemptions}"),
    ]
    return "perf:\n" + "\n".join(f"  {n:<8}{t:>10}   {d}".rstrip() for n, t, d in rows)


def chat(llm, sampling, system_prompt=None, stdin=None, stdout=None) -> int:
    """A chat REPL: each line is a user message; the reply streams. With a chat template the
    conversation is multi-turn; otherwise each message stands alone."""
    from compiled_llm.errors import CompiledLLMError
    from compiled_llm.model.tokenizer import DEFAULT_SYSTEM_PROMPT

    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    tok = llm.tokenizer
    if tok is None:
        raise CompiledLLMError("--interactive needs a tokenizer, and this engine has none")
    system = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
    multi_turn = tok.has_chat_template
    messages = [{"role": "system", "content": system}] if system else []
    print("chat: type a message, empty line or Ctrl-D to quit", file=stdout, flush=True)
    while True:
        print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or not line.strip():
            return 0
        user = line.rstrip("\n")
        if multi_turn:
            messages.append({"role": "user", "content": user})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        else:
            ids = tok.encode_chat(user, system)
        reply = []
        for delta in llm.stream({"prompt_token_ids": list(ids)}, sampling):
            reply.append(delta)
            print(delta, end="", file=stdout, flush=True)
        print(file=stdout, flush=True)
        if multi_turn:
            messages.append({"role": "assistant", "content": "".join(reply)})
