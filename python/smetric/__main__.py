import sys

from smetric.cli import main

sys.exit(main())
