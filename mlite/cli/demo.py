"""`mlite demo`: generate data and a tokenizer, build a tiny Qwen3-shaped model, fine-tune it (SFT), then
reinforce correct arithmetic with GRPO (built-in rollout, arithmetic reward), in a few minutes on 2 CPU
cores; writes checkpoints, metrics (JSONL, TensorBoard) and plots, and prints held-out results.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="tiny end-to-end run on generated data (CPU: a few minutes)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: a GPU when one is visible, else the CPU")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the demo's SFT job, e.g. --set trainer.steps=50 (repeatable)")
    parser.add_argument("--grpo-set", dest="grpo_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the demo's GRPO job (preset demo_grpo), e.g. "
                             "--grpo-set trainer.steps=10 (repeatable)")
    parser.add_argument("--no-grpo", action="store_true", help="stop after SFT")
    parser.add_argument("--prepare-only", action="store_true",
                        help="write data, tokenizer and model config, print the `mlite sft` command, stop")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    parser.set_defaults(run=run)


def run(args) -> int:
    import logging
    from pathlib import Path

    from mlite.errors import MliteError
    from mlite.trainers.demo import demo_overrides, prepare_demo, print_demo_summary, run_demo
    from mlite.trainers.metrics import stream_console

    logging.basicConfig(level=logging.INFO, format="mlite demo: %(message)s")
    console = stream_console()
    if args.prepare_only:
        paths = prepare_demo(Path(args.out))
        overrides = demo_overrides(Path(args.out), paths, args.device)
        print(" ".join(["mlite sft demo_sft", *(f"--set {o}" for o in overrides)]))
        return 0
    if args.no_grpo and args.grpo_overrides:
        raise MliteError("--grpo-set changes the GRPO stage, which --no-grpo skips; drop one of them")
    result = run_demo(args.out, args.device, tuple(args.overrides), console,
                      show_progress=not args.no_progress,
                      stage_overrides={"grpo": tuple(args.grpo_overrides)},
                      skip=frozenset({"grpo"} if args.no_grpo else ()))
    print_demo_summary(result, console)
    return 0
