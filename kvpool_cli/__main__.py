"""`python -m kvpool_cli ...`: the `kvpool` command (how child processes are started)."""
import sys

from kvpool_cli.main import main

sys.exit(main())
