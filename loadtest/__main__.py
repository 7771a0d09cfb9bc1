"""`python -m loadtest serve|users|plot|matrix`."""

from loadtest.cli import main

main()
