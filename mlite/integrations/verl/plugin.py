"""Imported by verl through the `verl.plugins` entry point (verl imports it, calls nothing): registers."""

from mlite.integrations.verl import register

register()
