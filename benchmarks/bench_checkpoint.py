"""A Hugging Face checkpoint of a preset's shape with random weights and a given tokenizer
(``bench_tokenizer.py``'s, of a real model's size): what the structured workload measures on,
since the presets' own tokenizer has 259 tokens and grammar masks scale with the vocabulary.

    python benchmarks/bench_checkpoint.py qwen2.5-0.5b TOKENIZER_DIR OUT_DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def write_checkpoint(preset: str, tokenizer_dir: Path, out: Path, device: str) -> None:
    import torch
    import transformers

    from compiled_llm.model.presets import preset_hf_config

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    fields = dict(preset_hf_config(preset))
    assert len(tok) <= fields["vocab_size"], f"{len(tok)} tokens do not fit {preset}'s {fields['vocab_size']}"
    fields.update(eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None, torch_dtype="bfloat16")
    config = transformers.AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    print(f"{preset} with {len(tok)} tokens -> {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset")
    parser.add_argument("tokenizer", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    write_checkpoint(args.preset, args.tokenizer, args.out, args.device)
