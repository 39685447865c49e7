"""Imported by verl through the `verl.plugins` entry point (verl imports it, calls nothing): importing the
package registers the engine and the cpu platform."""

import mlite.integrations.verl  # noqa: F401
