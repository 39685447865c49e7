from mlite.cli import entry

entry()
