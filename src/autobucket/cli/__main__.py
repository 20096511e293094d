import sys

from autobucket.cli.main import main

sys.exit(main())
