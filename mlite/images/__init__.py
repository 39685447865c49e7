"""The pinned images this project distributes: what goes into them, how they are built, how one is checked.

- `stacks`: a stack, `docker/stacks/<version>.toml`, pins every component of an image; loaded and validated
  here (known-bad pin sets are refused in one line).
- `build`: the docker commands (build, push, pull, shell) and the resolver command, built from a stack;
  `invoke build/push/pull/shell` call them.
- `doctor`: `mlite doctor`, an environment compared with a stack's pins (the image's build self-check too).

Config layer: no torch, no third-party imports (`doctor` alone imports torch, inside the checks that read
the GPUs, and is imported only by the CLI).
"""
