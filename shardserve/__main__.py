import sys

from shardserve.cli import main

sys.exit(main())
