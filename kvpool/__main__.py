import sys

from kvpool.cli import main

sys.exit(main())
