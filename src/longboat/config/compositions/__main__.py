"""``python -m longboat.config.compositions``: print ``docs/compositions.md``."""

from longboat.config.compositions.page import main

main()
