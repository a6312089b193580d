import sys

from deimos.cli import main

sys.exit(main())
