"""`mlite export CKPT --out DIR`: write an HF checkpoint (safetensors + config.json) from a training
checkpoint, or from a run directory (its newest good checkpoint). transformers loads the result.
"""

from __future__ import annotations

import argparse

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("export", help="training checkpoint -> HF safetensors checkpoint",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="checkpoint dir (…/checkpoints/step_N) or a run's output dir")
    parser.add_argument("--out", required=True, help="new directory for the HF checkpoint")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="store tensors in this dtype (default: as trained, fp32)")
    parser.set_defaults(run=run)


def run(args) -> int:
    import torch

    from mlite.cli.training import launcher_env
    from mlite.runtime.ckpt.hf import check_export_dir
    from mlite.runtime.engine import export_checkpoint

    launcher_env()  # the rebuilt model's device comes from LOCAL_RANK
    check_export_dir(args.out)  # before the model is built and loaded: a wrong --out is refused at once
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    out = export_checkpoint(args.checkpoint, args.out, dtype)
    print(f"mlite export: wrote {out}")
    return 0
