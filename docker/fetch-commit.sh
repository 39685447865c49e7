#!/usr/bin/env bash
# Fetch exactly one commit of a git repository (with its submodules) into a folder: the image build's only
# way to get source, so nothing follows a branch or a tag.
#   fetch-commit.sh URL COMMIT DEST
set -euo pipefail

URL=${1:?usage: fetch-commit.sh URL COMMIT DEST}
COMMIT=${2:?usage: fetch-commit.sh URL COMMIT DEST}
DEST=${3:?usage: fetch-commit.sh URL COMMIT DEST}

if [[ ! "$COMMIT" =~ ^[0-9a-f]{40}$ ]]; then
  echo "fetch-commit: '$COMMIT' is not a full 40-hex commit; pin the commit in docker/stacks/<version>.toml" >&2
  exit 2
fi
git init --quiet "$DEST"
git -C "$DEST" remote add origin "$URL"
git -C "$DEST" fetch --quiet --depth 1 origin "$COMMIT"
git -C "$DEST" checkout --quiet FETCH_HEAD
git -C "$DEST" submodule update --quiet --init --recursive --depth 1
test "$(git -C "$DEST" rev-parse HEAD)" = "$COMMIT"
