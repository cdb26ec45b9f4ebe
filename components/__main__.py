"""`python -m components`: print `REF DOCKERFILE` for every image (used by `make images`)."""

import sys

from .images import main

sys.exit(main())
