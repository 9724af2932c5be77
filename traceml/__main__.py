import sys

from traceml.cli import main

sys.exit(main())
