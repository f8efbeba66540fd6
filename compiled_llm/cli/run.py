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
import json
import sys
from pathlib import Path

from compiled_llm.cli.engine_args import add_engine_arguments

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


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
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weight and activation dtype; auto = the checkpoint's float16/bfloat16 on cuda "
                        "(bfloat16 when it is float32 or says nothing), float32 on cpu")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to run; auto = cuda when available, else cpu")
    p.add_argument("--chat", action="store_true",
                   help="wrap each text prompt in the tokenizer's chat template (a plain "
                        "'User:/Assistant:' transcript when it has none)")
    p.add_argument("--system-prompt", default=None, metavar="TEXT",
                   help="system message for --chat (default: 'You are a helpful assistant.')")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt per line: prompt_token_ids, token_ids, "
                        "text, finish_reason; no perf summary")
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


def is_engine_dir(source: str) -> bool:
    return (Path(source).expanduser() / "manifest.json").is_file()


def parse_prompt_ids(text: str) -> list[int]:
    from compiled_llm.errors import InvalidRequestError

    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise InvalidRequestError(f"--prompt-ids {text!r} is not a comma-separated list of integers") from None
    if not ids:
        raise InvalidRequestError("--prompt-ids is empty; give at least one token id")
    return ids


def sampling_from_args(args):
    """One SamplingParams for every prompt of the command (validated: bad values raise)."""
    from compiled_llm.serve.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )


def check_prompt_args(args) -> None:
    """The prompt mistakes that need no tokenizer, found before anything loads or builds."""
    from compiled_llm.errors import CompiledLLMError

    if not args.prompt and not args.prompt_ids and not getattr(args, "interactive", False):
        raise CompiledLLMError("no prompt given; pass --prompt TEXT or --prompt-ids 1,2,3")
    for text in args.prompt_ids or []:
        parse_prompt_ids(text)


def prompts_from_args(args, tokenizer) -> list[list[int]]:
    """Token ids of every prompt: the --prompt texts (chat-wrapped with --chat), then --prompt-ids."""
    from compiled_llm.errors import CompiledLLMError
    from compiled_llm.model.tokenizer import DEFAULT_SYSTEM_PROMPT

    texts = args.prompt or []
    if not texts and not args.prompt_ids:
        raise CompiledLLMError("no prompt given; pass --prompt TEXT or --prompt-ids 1,2,3")
    if texts and tokenizer is None:
        raise CompiledLLMError(
            f"--prompt needs a tokenizer but {args.source} has none (no tokenizer.json, "
            "tokenizer_config.json or tokenizer.model); pass --prompt-ids instead"
        )
    system = args.system_prompt if args.system_prompt is not None else DEFAULT_SYSTEM_PROMPT
    prompts = [tokenizer.encode_chat(t, system) if args.chat else tokenizer.encode(t) for t in texts]
    prompts += [parse_prompt_ids(s) for s in args.prompt_ids or []]
    return prompts


def resolve_device(name: str):
    import torch

    from compiled_llm.errors import CompiledLLMError

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise CompiledLLMError("--device cuda was given but no CUDA GPU is available to torch")
    return torch.device(name)


def resolve_dtype(name: str, device, source=None):
    """--dtype for ``device``; "auto" follows the checkpoint of ``source`` (build.resolve_dtype)."""
    from compiled_llm.engine.build import resolve_dtype as resolve

    return resolve(name, device, source)


def output_record(prompt_token_ids, token_ids, text: str | None, finish_reason: str) -> dict:
    """The --json line of one prompt."""
    return {
        "prompt_token_ids": list(prompt_token_ids),
        "token_ids": list(token_ids),
        "text": text or "",
        "finish_reason": finish_reason,
    }


def print_json_record(record: dict, file=None) -> None:
    print(json.dumps(record, ensure_ascii=False), file=file or sys.stdout, flush=True)


def print_readable(index: int, prompt_text: str, record: dict, file=None) -> None:
    out = file or sys.stdout
    n_prompt, n_out = len(record["prompt_token_ids"]), len(record["token_ids"])
    print(f"=== prompt {index} ({n_prompt} tokens) ===", file=out)
    print(prompt_text, file=out)
    print(f"--- output ({n_out} tokens, finish: {record['finish_reason']}) ---", file=out)
    text = record["text"]
    if text.strip():
        print(text, file=out)
    else:  # empty or only whitespace (random-weight presets often say "\n" 32 times)
        print(f"{text!r} (token ids {record['token_ids']})", file=out)
    print(file=out, flush=True)


def print_outputs(outputs, prompt_texts: list[str], as_json: bool) -> None:
    """One JSON line or one readable block per output (anything with prompt_token_ids,
    token_ids, text and finish_reason)."""
    for i, (o, prompt_text) in enumerate(zip(outputs, prompt_texts)):
        record = output_record(o.prompt_token_ids, o.token_ids, o.text, o.finish_reason)
        if as_json:
            print_json_record(record)
        else:
            print_readable(i, prompt_text, record)


def print_run_header(name: str, device, dtype, path: str, preset: str | None) -> None:
    print(f"{name} on {torch_device_type(device)}, {str(dtype).removeprefix('torch.')}, {path}")
    if preset:
        print(f"note: {preset} is a preset with random weights: its text is noise, its speed is real")


def torch_device_type(device) -> str:
    return getattr(device, "type", str(device))


def format_perf(load_s: float, prefill_s: float, prompt_tokens: int, decode_s: float,
                decode_tokens: int, new_tokens: int) -> str:
    """The perf summary printed after readable output."""
    rate = lambda n, s: f"{n / s:,.1f} tok/s" if s > 0 else "n/a"  # noqa: E731
    rows = [
        ("load", f"{load_s:.3f} s", "weights and warm-up"),
        ("prefill", f"{prefill_s:.3f} s", f"{prompt_tokens} prompt tokens, {rate(prompt_tokens, prefill_s)}"),
        ("decode", f"{decode_s:.3f} s", f"{decode_tokens} tokens, {rate(decode_tokens, decode_s)}"),
        ("total", f"{prefill_s + decode_s:.3f} s", f"{new_tokens} new tokens, {rate(new_tokens, prefill_s + decode_s)}"),
    ]
    return "perf:\n" + "\n".join(f"  {name:<8}{t:>10}   {detail}".rstrip() for name, t, detail in rows)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def run(args) -> int:
    from compiled_llm.errors import CompiledLLMError

    if is_engine_dir(args.source):
        if args.eager:
            raise CompiledLLMError(
                f"--eager runs a model source on the reference loop, but {args.source} is an engine "
                "directory: an engine is already compiled; use --enforce-eager to skip CUDA graphs"
            )
        try:
            from compiled_llm.cli.run_engine import run_engine
        except ModuleNotFoundError as e:
            if e.name != "compiled_llm.cli.run_engine":
                raise  # a real bug inside the runtime, not a missing runtime
            raise CompiledLLMError(
                f"{args.source} is an engine directory, but this install has no engine runtime "
                "(compiled_llm.cli.run_engine); run a checkpoint directory or preset instead"
            ) from None
        return int(run_engine(args) or 0)
    if args.eager:
        return run_reference(args)
    from compiled_llm.cli.run_engine import run_engine

    return int(run_engine(args) or 0)


def run_reference(args) -> int:
    import time

    from compiled_llm.serve.reference import check_request, generate_reference
    from compiled_llm.serve.sampling import SamplingParams
    from compiled_llm.model.sources import load_source_params, load_source_tokenizer, resolve_source, source_eos_token_ids

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
