import sys

from benchmarks.collectives.cli import main

sys.exit(main())
