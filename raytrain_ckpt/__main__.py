import sys

from raytrain_ckpt.cli.main import main

sys.exit(main())
