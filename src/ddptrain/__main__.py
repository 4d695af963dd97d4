import sys

from ddptrain.cli import main

sys.exit(main())
