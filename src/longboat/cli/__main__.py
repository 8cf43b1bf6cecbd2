"""``python -m longboat.cli`` runs the command line."""

from longboat.cli import main

main()
