"""Check that transformers loads an mlite export of a DeepSeek-V4 fixture case with the reference logits.

Load an mlite export of a DeepSeek-V4 fixture case in transformers (>= 5.23) and compare its logits with
the fixture's reference. RUNS ONLY IN THE SIDE ENVIRONMENT (see scripts/dsv4_reference.py); it must not
import mlite. Usage: python scripts/dsv4_load_check.py EXPORT_DIR REFERENCE.safetensors"""

from __future__ import annotations

import sys

import torch
from safetensors.torch import load_file
from transformers import DeepseekV4ForCausalLM


def main(export_dir: str, reference: str) -> None:
    model = DeepseekV4ForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    ref = load_file(reference)
    count = sum(k.startswith("input_ids.") for k in ref)
    for i in range(count):
        with torch.no_grad():
            logits = model(ref[f"input_ids.{i}"][None]).logits[0]
        error = (logits - ref[f"logits.{i}"]).abs().max().item()
        assert error < 1e-5, f"sequence {i}: transformers' logits of the export differ by {error:.3g}"
    print(f"transformers loads {export_dir}: logits of {count} sequences equal the reference")


if __name__ == "__main__":
    main(*sys.argv[1:3])
