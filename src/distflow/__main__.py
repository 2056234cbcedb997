import sys

from distflow.cli import main

sys.exit(main())
