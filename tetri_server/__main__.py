import sys

from tetri_server.cli import main

sys.exit(main())
