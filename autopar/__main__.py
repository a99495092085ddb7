from autopar.cli import entry

entry()
