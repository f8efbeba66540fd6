"""Load engines and use each once, in a process of its own (the tamper fuzz of
test_engine_safety.py runs this, so that its peak RSS is the loads' alone).

    python engine_load_child.py LIST.json

LIST.json holds engine directories. Each is loaded, its program run for one step of a tiny
batch, and its tokenizer asked to encode, decode and render the chat template; prints one JSON
object: {"outcomes": [{"engine", "outcome": "ran" | "refused" | "traceback", "message"}],
"peak_rss_kib": the process's peak resident set}.
"""

import json
import resource
import sys
import traceback


def use_once(path: str) -> None:
    import torch

    from compiled_llm.engine import artifact
    from compiled_llm.graph.batch import ScheduledSeq, pack_batch
    from compiled_llm.model.spec import kv_cache_shape

    loaded = artifact.load_engine(path)
    batch = pack_batch([ScheduledSeq([5, 6, 7], 0, [1]), ScheduledSeq([9], 4, [0])], 16)
    kv = torch.zeros(kv_cache_shape(loaded.config, 3, 16), dtype=loaded.dtype)
    loaded.program(loaded.params, batch, kv)
    if loaded.tokenizer is not None:
        ids = loaded.tokenizer.encode("hello there")
        loaded.tokenizer.decode(ids)
        if loaded.tokenizer.has_chat_template:
            loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def outcome(path: str) -> dict:
    from compiled_llm.errors import CompiledLLMError

    try:
        use_once(path)
        return {"engine": path, "outcome": "ran", "message": ""}
    except CompiledLLMError as e:
        return {"engine": path, "outcome": "refused", "message": str(e)}
    except BaseException as e:  # every one of these is a bug the fuzz reports
        return {"engine": path, "outcome": "traceback", "message": f"{type(e).__name__}: {str(e)[:300]}",
                "trace": traceback.format_exc()[-3000:]}


def main() -> None:
    with open(sys.argv[1]) as f:
        engines = json.load(f)
    outcomes = [outcome(path) for path in engines]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"outcomes": outcomes, "peak_rss_kib": peak}))


if __name__ == "__main__":
    main()
