from align.cli import main

raise SystemExit(main())
