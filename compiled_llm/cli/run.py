"""`compiled-llm run`: generate text from a model.

SOURCE is a checkpoint directory, a built-in preset, a hub id, or a built engine directory (one
holding manifest.json). Everything runs on the compiled runtime (``compiled_llm.cli.run_engine``):
a model source is first built into the engine cache (``compiled_llm.engine.cache``; once, later
runs load the cached engine). ``--eager`` runs a model source on the eager reference loop
(``compiled_llm.serve.reference``) instead, which is also what the runtime is checked against.

The helpers below (prompt parsing, sampling, output records) are shared with the engine path so
both print exactly the same formats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from compiled_llm.cli.engine_args import (add_build_arguments, add_engine_arguments, build_config, build_options,
                                          engine_options, field_flag)
from compiled_llm.cli.run_io import (check_prompt_args, format_perf, print_outputs, print_run_header, prompts_from_args,
                                     sampling_from_args)
from compiled_llm.errors import CompiledLLMError
from compiled_llm.model.tokenizer import DEFAULT_SYSTEM_PROMPT

BUILD_GROUP = ("how a SOURCE is built into the engine cache (each option a cache entry of its own), and where it "
               "runs; given for an engine directory, an option must be what the engine was built with")


def add_parser(subparsers):
    from compiled_llm.model.presets import PRESET_NAMES

    p = subparsers.add_parser(
        "run",
        help="generate text from a checkpoint, preset, hub id or built engine",
        description=(
            "Generate from SOURCE. Greedy unless --temperature > 0. Prompts run batched on the "
            "compiled runtime: a checkpoint, preset or hub id is built into the engine cache on "
            "first use ($COMPILED_LLM_CACHE_DIR, else ~/.cache/compiled_llm) and loaded from it "
            "afterwards. --eager runs it one prompt after another on the eager reference path instead."
        ),
    )
    p.add_argument(
        "source",
        metavar="SOURCE",
        help=(
            "a Hugging Face checkpoint directory, a built-in preset with random weights "
            f"({', '.join(PRESET_NAMES)}), a hub id org/name (downloaded when the network allows), "
            "or an engine directory made by 'compiled-llm build' (it contains manifest.json)"
        ),
    )
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a text prompt (repeat for several); needs a tokenizer in SOURCE")
    p.add_argument("--prompt-ids", action="append", metavar="IDS",
                   help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeat for several); "
                        "runs after the --prompt prompts")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N",
                   help="most new tokens per prompt (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 (the default) is greedy")
    p.add_argument("--top-k", type=int, default=-1, metavar="K",
                   help="sample only among the K most likely tokens; -1 (default) disables")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample only from the smallest set of tokens whose probability reaches P, "
                        "in (0, 1]; 1 (default) disables")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="seed of each prompt's sampling stream, for reproducible sampled output")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-sequence tokens until --max-tokens")
    p.add_argument("--eager", action="store_true",
                   help="run a model source on the eager reference loop (one prompt at a time, no build, "
                        "no engine cache) instead of compiling it; not for engine directories")
    p.add_argument("--chat", action="store_true",
                   help="wrap each text prompt in the tokenizer's chat template (a plain "
                        "'User:/Assistant:' transcript when it has none)")
    p.add_argument("--system-prompt", default=None, metavar="TEXT",
                   help="system message for --chat (default: 'You are a helpful assistant.')")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt per line: prompt_token_ids, token_ids, "
                        "text, finish_reason; no perf summary")
    add_build_arguments(p.add_argument_group("build", BUILD_GROUP), for_source=True)
    # --- compiled-runtime options ---
    eng = p.add_argument_group("compiled runtime (engine directories, and sources without --eager)")
    eng.add_argument("--stream", action="store_true",
                     help="print each prompt's text as it is generated (one prompt after another)")
    eng.add_argument("--interactive", action="store_true",
                     help="chat REPL: read a message per line, stream the reply; empty line or EOF quits")
    eng.add_argument("--profile", metavar="DIR", default=None,
                     help="write a torch.profiler chrome trace (labels schedule/forward/sample) to DIR, "
                          "and on a GPU a CUDA memory snapshot")
    add_engine_arguments(eng)
    eng.add_argument("--no-cuda-graphs", dest="enforce_eager", action="store_true",
                     help=argparse.SUPPRESS)  # the old name of --enforce-eager
    # --- end compiled-runtime options ---
    p.set_defaults(handler=run)


# ---------------------------------------------------------------------------------------------
# Shared helpers (reference and engine paths)
# ---------------------------------------------------------------------------------------------
# Entry point: torch and the runtime are imported only here, so that --help stays instant
# ---------------------------------------------------------------------------------------------


def run(args) -> int:
    from compiled_llm.engine.loader import is_engine_dir

    build_config(args, for_source=True)  # bad values fail before anything loads
    if is_engine_dir(args.source):
        if args.eager:
            raise CompiledLLMError(
                f"--eager runs a model source on the reference loop, but {args.source} is an engine "
                "directory: an engine is already compiled; use --enforce-eager to skip CUDA graphs"
            )
        return run_engine(args)
    if args.eager:
        if args.speculative_config:
            raise CompiledLLMError("--speculative-config needs the compiled runtime: --eager runs the reference loop")
        check_eager_build_options(args)
        return run_reference(args)
    return run_engine(args)


def check_eager_build_options(args) -> None:
    """--eager runs the original weights on the reference loop: no build option but the dtype
    and device applies there."""
    import dataclasses

    from compiled_llm.engine.build_config import BuildConfig

    given, config, default = build_options(args, for_source=True), build_config(args, for_source=True), BuildConfig()
    for f in dataclasses.fields(BuildConfig):
        if f.name in given and f.name not in ("dtype", "device") and getattr(config, f.name) != getattr(default, f.name):
            raise CompiledLLMError(f"{field_flag(f)} needs the compiled path: --eager runs the original model "
                                   "on the reference loop")


def run_reference(args) -> int:
    from compiled_llm.model.placement import resolve_device, resolve_dtype
    from compiled_llm.model.sources import load_source_params, load_source_tokenizer, resolve_source, source_eos_token_ids
    from compiled_llm.serve.reference import check_request, generate_reference
    from compiled_llm.serve.sampling_params import SamplingParams

    sampling = sampling_from_args(args)  # bad values fail before anything loads
    device = resolve_device(args.device)
    src = resolve_source(args.source)
    dtype = resolve_dtype(args.dtype, device, src)
    tokenizer = load_source_tokenizer(src)
    prompts = prompts_from_args(args, tokenizer)
    for p in prompts:
        check_request(src.config, p, sampling)

    t0 = time.perf_counter()
    params = load_source_params(src, dtype, device)
    load_s = time.perf_counter() - t0
    # One throwaway step, so one-time costs (kernel loading, allocator growth) stay out of the
    # prefill time of the first prompt.
    t0 = time.perf_counter()
    generate_reference(src.config, params, [[0, 0]], SamplingParams(max_tokens=1, temperature=0.0))
    warmup_s = time.perf_counter() - t0

    detok = tokenizer.decode if tokenizer is not None else None
    outputs = generate_reference(
        src.config, params, prompts, sampling, eos_token_ids=source_eos_token_ids(src, tokenizer), detokenize=detok
    )
    print_outputs(outputs, list(args.prompt or []) + list(args.prompt_ids or []), args.json)
    if not args.json:
        print_run_header(src.name, device, dtype, "reference (eager) path", src.preset)
        print(format_perf(
            load_s + warmup_s,
            prefill_s=sum(o.prefill_s for o in outputs),
            prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
            decode_s=sum(o.decode_s for o in outputs),
            decode_tokens=sum(max(len(o.token_ids) - 1, 0) for o in outputs),
            new_tokens=sum(len(o.token_ids) for o in outputs),
        ))
    return 0


def engine_of(args) -> str:
    """The engine directory to run: SOURCE itself, or its cached engine (built on first use as
    the build flags say)."""
    from compiled_llm.engine.cache import cached_engine
    from compiled_llm.engine.loader import is_engine_dir
    from compiled_llm.serve.kernel_warmup import warm_kernels

    if is_engine_dir(args.source):
        return args.source
    return str(cached_engine(args.source, build_config(args, for_source=True), warm_up=warm_kernels))


def build_llm(args):
    """The LLM of ``run`` / ``serve``: the engine of ``engine_of``, loaded with the build options
    given (which an engine directory must have been built with) and the engine options."""
    from compiled_llm.serve.llm import LLM

    return LLM(engine_of(args), **build_options(args, for_source=True), **engine_options(args))


def run_engine(args) -> int:
    from compiled_llm.engine.loader import is_engine_dir
    from compiled_llm.serve.profiling import profile_engine

    sampling = sampling_from_args(args)  # bad values fail before anything loads (or builds)
    check_prompt_args(args)
    if args.profile and args.data_parallel_size > 1:
        raise CompiledLLMError("--profile traces the engine in this process; with --data-parallel-size the engines "
                               "run in processes of their own: profile one engine, without it")
    t0 = time.perf_counter()
    llm = build_llm(args)
    load_s = time.perf_counter() - t0
    try:
        if args.interactive:
            return chat(llm, sampling, args.system_prompt)
        prompts = prompts_from_args(args, llm.tokenizer)
        requests = [{"prompt_token_ids": p} for p in prompts]
        texts = list(args.prompt or []) + list(args.prompt_ids or [])

        t_run = time.perf_counter()
        with profile_engine(args.profile, llm.engine if args.profile else None, llm.model.device):
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
            where = "compiled runtime" if is_engine_dir(args.source) else f"compiled runtime, cached engine {llm.model.name}"
            if llm.data_parallel_size > 1:
                where += f", {llm.data_parallel_size} data-parallel replicas"
            print_run_header(args.source, llm.model.device, llm.model.dtype, where, preset)
            print(perf_summary(llm, outputs, load_s, wall))
        return 0
    finally:
        # a tensor-parallel or pipelined engine's ranks end here, not at exit: main() may be
        # called again in this process (tests, a script), which starts a group of its own
        llm.shutdown()


def perf_summary(llm, outputs, load_s: float, wall_s: float) -> str:
    """The perf lines of ``run``; over data-parallel replicas their counters added up (seconds
    of prefill and decode as engine-seconds, so their rates are a replica's)."""
    from compiled_llm.serve.llm_engine import total_stats

    st = total_stats(s for s in llm.replica_stats() if s is not None)
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    rate = lambda n, s: f"{n / s:,.1f} tok/s" if s > 0 else "n/a"  # noqa: E731
    graphs = f"{st.graph_capture_s:.3f} s" if st.graphs_captured else "-"
    rows = [
        ("load", f"{load_s:.3f} s", f"KV cache {st.kv_num_blocks} blocks"),
        ("graphs", graphs, f"{st.graphs_captured} decode buckets captured" if st.graphs_captured else "eager decode"),
        ("ttft", f"{(statistics.median(ttfts) if ttfts else 0):.3f} s", "median time to first token"),
        ("prefill", f"{st.prefill_s:.3f} s", f"{st.prefill_tokens} tokens, {rate(st.prefill_tokens, st.prefill_s)}"),
        ("decode", f"{st.decode_s:.3f} s", f"{st.decode_tokens} tokens, {rate(st.decode_tokens, st.decode_s)}"),
        ("total", f"{wall_s:.3f} s", f"{st.generated_tokens} tokens generated, {rate(st.generated_tokens, wall_s)}"),
        ("cache", "", f"prefix-cache hits {st.prefix_hit_tokens} tokens, preemptions {st.preemptions}"),
    ]
    if llm.data_parallel_size == 1 and llm.engine.speculator is not None:
        sp = llm.engine.speculator.stats
        rows.append(("spec", f"{sp.acceptance_rate:.1%}",
                     f"of {sp.draft_tokens} draft tokens accepted, mean accepted length {sp.mean_accepted_length:.2f} "
                     f"over {sp.verify_steps} verification steps"))
    return "perf:\n" + "\n".join(f"  {n:<8}{t:>10}   {d}".rstrip() for n, t, d in rows)


def chat(llm, sampling, system_prompt=None, stdin=None, stdout=None) -> int:
    """A chat REPL: each line is a user message; the reply streams. With a chat template the
    conversation is multi-turn; otherwise each message stands alone."""
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
