import sys

from overlap.cli import main

sys.exit(main())
