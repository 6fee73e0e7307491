import sys

from draftflow.core.cli import main

sys.exit(main())
