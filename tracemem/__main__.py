import sys

from tracemem.cli import main

sys.exit(main())
