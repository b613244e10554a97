"""`python -m common.engine.kernels`: build the kernels for this CPU (what `make` runs)."""

from common.engine.kernels import main

raise SystemExit(main())
