import sys

from ivyplug.cli import main

sys.exit(main())
