"""`python -m tp_engine.server ...`: the same server as `launch/serve.py` (the data-parallel
launcher starts its replicas this way, which needs no checkout)."""

from tp_engine.server.rank0.main import main

raise SystemExit(main())
