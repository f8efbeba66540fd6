"""What ``compiled-llm run`` reads from its arguments and prints: prompts, sampling options,
output records and the perf summary, the same for the compiled runtime and the eager reference
loop."""

from __future__ import annotations

import json
import sys

from compiled_llm.errors import CompiledLLMError, InvalidRequestError
from compiled_llm.model.tokenizer import DEFAULT_SYSTEM_PROMPT

def parse_prompt_ids(text: str) -> list[int]:
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
    from compiled_llm.serve.sampling_params import SamplingParams

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
    if not args.prompt and not args.prompt_ids and not getattr(args, "interactive", False):
        raise CompiledLLMError("no prompt given; pass --prompt TEXT or --prompt-ids 1,2,3")
    for text in args.prompt_ids or []:
        parse_prompt_ids(text)


def prompts_from_args(args, tokenizer) -> list[list[int]]:
    """Token ids of every prompt: the --prompt texts (chat-wrapped with --chat), then --prompt-ids."""
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
