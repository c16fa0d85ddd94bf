import sys

from raytrain_ckpt.cli import main

sys.exit(main())
