from .interfaces.cli import main

raise SystemExit(main())
