"""`mlite doctor`: check this environment against a container stack's pins (see mlite/images/doctor.py)."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check installed versions, GPU arch, NCCL and cuDNN DSA against a stack's pins",
        description=(
            "Report what this environment has against a stack (docker/stacks/<version>.toml): installed "
            "versions vs pins, imports, GPU architecture vs the image's arch list, NCCL, the cuDNN frontend "
            "DSA indexer. Exit 0; with --strict, 1 when anything is missing or wrong."
        ),
    )
    parser.add_argument(
        "--stack", help="stack version (default: $MLITE_STACK set by the image, else the newest)"
    )
    parser.add_argument(
        "--arch",
        choices=["sm90", "sm100"],
        help="image arch to check the GPUs against (default: $MLITE_IMAGE_ARCH, else from the GPU)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when anything is missing or wrong")
    parser.add_argument("--require-gpu", action="store_true", help="count a missing GPU as a problem")
    parser.set_defaults(run=run)


def run(args) -> int:
    from mlite.images import doctor

    return doctor.run(args.stack, args.arch, args.strict, args.require_gpu)
